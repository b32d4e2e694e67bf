"""MCP server events said while the model loads reach the Events log once it is loaded
(tui/services/tools.py, docs/DESIGN.md §12.1, §16): the engine keeps events only with a
cache, which it has once a model is loaded, and the servers start with the app, while the
first model loads. A server that fails to start is shown with its stderr tail."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest
from fakes import FakeEngine
from textual.widgets import RichLog
from tierchat.core.tools.config import ServerConfig
from tierchat.core.tools.mcp_host import McpHost
from tui_kit import chat_screen, wait_for

pytestmark = pytest.mark.anyio

BROKEN = (
    "import sys; print('kit: cannot open the notes database', file=sys.stderr, flush=True);"
    " sys.exit(3)"
)


class LoadingEngine(FakeEngine):
    """No model at start (the app loads ``settings.model``); the load holds until
    ``release`` is set. Until a model is loaded the engine has no cache, as the real one:
    its stats say caching is off and :meth:`note` drops the line."""

    def __init__(self) -> None:
        super().__init__("")
        self.release = threading.Event()
        self.dropped: list[str] = []

    def note(self, text: str) -> None:
        with self._lock:
            if not self.model_name:
                self.dropped.append(text)
                return
            self._log(text)

    def stats(self):
        stats = super().stats()
        return stats if self.model_name else dataclasses.replace(stats, enabled=False)

    def _load(self, model, handle) -> None:
        self.release.wait(60)
        super()._load(model, handle)


def events_text(app) -> str:
    log = chat_screen(app).query_one("#events-log", RichLog)
    return "\n".join(strip.text.rstrip() for strip in log.lines)


async def test_a_server_failing_while_the_model_loads_shows_in_the_events_log(store, settings):
    from textual.clock import MockClock
    from tierchat.tui.app import TierchatApp

    engine = LoadingEngine()
    host = McpHost([ServerConfig("notes", "stdio", command=sys.executable, args=("-c", BROKEN))])
    app = TierchatApp(engine, store, settings, clock=MockClock(0.0), mcp_host=host)
    app.animation_level = "none"
    try:
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_for(pilot, lambda: app.tools.ready.is_set(), what="the MCP server")
            await wait_for(pilot, lambda: app.tools.pending, what="the failure's event")
            assert chat_screen(app).loading_model == "demo"  # still loading: kept, not noted
            assert engine.dropped == [] and engine.stats().events == ()

            engine.release.set()
            await wait_for(
                pilot,
                lambda: "MCP server notes failed" in events_text(app),
                what="the event in the Events log",
            )
            shown = events_text(app)
            assert "kit: cannot open the notes database" in shown  # its stderr tail
            assert app.tools.pending == [] and engine.dropped == []
    finally:
        host.close()
        engine.release.set()
        engine.close()
