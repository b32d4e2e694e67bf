"""``tierchat serve --console`` with Pilot, over the fake engine behind a real server on
127.0.0.1: the request log, the queue depth, the clear keys, the chat pane's turns going
through the same queue, and no MLX in the TUI."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fakes import FakeEngine
from textual.clock import MockClock
from textual.widgets import DataTable, Static
from tierchat.config.settings import Settings
from tierchat.core.chat.store import ConversationStore
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.app import create_app
from tierchat.core.serve.log import RequestLog, TrackedEngine
from tierchat.core.serve.server import ServerThread
from tierchat.core.serve.state import ServeState

pytestmark = pytest.mark.anyio
SIZE = (160, 40)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ClearingFake(FakeEngine):
    def __init__(self) -> None:
        super().__init__("fake")
        self.cleared: list[str] = []

    def clear(self, tier: str) -> None:
        self.cleared.append(tier)
        super().clear(tier)


@pytest.fixture
def console(tmp_path):
    """(app, tracked engine, server url): the console app, not yet running."""
    from tierchat.tui.screens.serve_console import ServeConsoleApp

    log = RequestLog()
    fake = ClearingFake()
    engine = TrackedEngine(fake, log)
    server = ServerThread(
        create_app(ServeState(engine, sampling=SamplingParams(max_tokens=64)))
    ).start()
    log.url = server.url + "/v1"
    settings = Settings(
        sampling=SamplingParams(max_tokens=64),
        model="fake",
        data_dir=tmp_path / "d",
        cache_dir=tmp_path / "kv",
    )
    store = ConversationStore(":memory:")
    app = ServeConsoleApp(engine, store, settings, log, clock=MockClock(0.0))
    app.animation_level = "none"
    yield app, engine, server.url
    fake.gate.set()
    server.stop()
    engine.close()
    store.close()


def post(url: str, text: str, user: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "user": user}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


async def until(pilot, condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.05)
        await pilot.pause()


def rows(app) -> list[list[str]]:
    table = app.screen.query_one(DataTable)
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def queue_text(app) -> str:
    return str(app.screen.query_one("#queue-line", Static).render())


async def test_request_log_shows_each_request_with_its_cache_sources(console):
    app, engine, url = console
    first = post(url, "Tell me about caches.", "alice").json()
    messages = [
        {"role": "user", "content": "Tell me about caches."},
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "More."},
    ]
    body = {"messages": messages, "user": "alice"}
    second = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: len(rows(app)) == 2)
        a, b = rows(app)
        assert a[2:5] == ["127.0.0.1 alice", "chat", "done"]
        assert a[5] == str(first["usage"]["prompt_tokens"]) and a[6] == "0"
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert b[6] == str(cached) and cached > 0
        assert b[7].startswith(f"hot {cached}") and "block" in b[7]
        assert b[8] == str(second["usage"]["tierchat"]["prefill_tokens"])
        assert "0 waiting · 0 running · 2 requests" in queue_text(app)
        assert url in queue_text(app)


async def test_queue_depth_shows_while_requests_wait(console):
    app, engine, url = console
    engine.engine.gate.clear()
    threads = [threading.Thread(target=post, args=(url, f"q{i}", f"c{i}")) for i in range(3)]
    async with app.run_test(size=SIZE) as pilot:
        for t in threads:
            t.start()
        await until(pilot, lambda: "2 waiting · 1 running" in queue_text(app))
        # the running row shows what it does (the fake engine has sent a token)
        assert [r[4] for r in rows(app)] == ["decoding", "queued", "queued"]
        engine.engine.gate.set()
        await until(pilot, lambda: "0 waiting · 0 running · 3 requests" in queue_text(app))
        await until(pilot, lambda: [r[4] for r in rows(app)] == ["done"] * 3)
    for t in threads:
        t.join(10)


async def test_clear_keys_confirm_then_clear_the_engine_tier(console):
    app, engine, _ = console
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f5")
        await pilot.pause()
        await pilot.press("n")  # cancelled: nothing cleared
        await pilot.press("f8")
        await pilot.pause()
        await pilot.press("y")
        await until(pilot, lambda: engine.engine.cleared == ["all"])
        await app.workers.wait_for_complete()
        await pilot.pause()


async def test_chat_pane_turns_go_through_the_same_queue(console):
    from tierchat.tui.screens.chat import ChatScreen
    from tierchat.tui.screens.serve_console import ServeConsoleScreen

    app, engine, url = console
    post(url, "from http", "bob")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f10")
        await pilot.pause()
        assert isinstance(app.screen, ChatScreen)
        await pilot.press(*"hello from chat", "enter")
        await until(pilot, lambda: len(engine.engine.requests) == 2)
        await until(pilot, lambda: not app.session.busy)
        await pilot.press("f10")
        await pilot.pause()
        assert isinstance(app.screen, ServeConsoleScreen)
        await until(pilot, lambda: len(rows(app)) == 2 and rows(app)[1][4] == "done")
        assert [r[2] for r in rows(app)] == ["127.0.0.1 bob", "chat"]


def test_console_imports_no_mlx():
    code = (
        "import sys, tierchat.tui.screens.serve_console, tierchat.core.serve.log; "
        "assert not any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules), 'mlx'; "
        "assert 'uvicorn' not in sys.modules and 'starlette' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
