"""Pilot tests: engine errors, restarts, progress, unsupported models, thread boundaries."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from textual.widgets import ProgressBar
from tierchat.core.chat.store import ConversationStore
from tierchat.tui.widgets.activity import ActivityBar
from tierchat.tui.widgets.cache_panels import CachePanels
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.transcript import Transcript
from tui_kit import SIZE, WIDE, FlakyEngine, chat_screen, fixed_clock, send, settle

pytestmark = pytest.mark.anyio


def shown(app) -> list[tuple[str, str]]:
    return [(v.info.role, v.info.content) for v in chat_screen(app).query_one(Transcript).views]


def notes(app, severity: str | None = None) -> list[str]:
    return [
        f"{n.title}: {n.message}"
        for n in app._notifications
        if severity is None or n.severity == severity
    ]


async def test_refused_prefill_is_a_notification_and_the_app_goes_on(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        engine.fail_next = "prefill refused: needs 9.1 GiB, limit 8.0 GiB"
        await send(pilot, "a very long prompt")
        assert any("needs 9.1 GiB" in n for n in notes(app, "error"))
        # nothing half is kept, and the text is back in the input for a retry
        assert shown(app) == []
        assert chat_screen(app).query_one(ChatInput).text == "a very long prompt"
        chat_screen(app).query_one(ChatInput).clear()
        await send(pilot, "shorter")
        assert shown(app)[-1][0] == "assistant"


async def test_engine_messages_are_shown_as_plain_text(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        engine.fail_next = "missing [b]config.json[/b] in [dim]/models/x[/]"  # markup-like
        await send(pilot, "hi")
        await settle(pilot)
        (toast,) = app.screen.query("Toast")
        assert "missing [b]config.json[/b] in [dim]/models/x[/]" in str(toast.render())


async def test_failed_regenerate_keeps_the_old_reply(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        engine.fail_next = "engine exploded"
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert shown(app) == [("user", "hi"), ("assistant", "Reply 1 to: hi")]
        assert any("engine exploded" in n for n in notes(app, "error"))


async def test_failed_model_load_is_a_notification(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        engine.fail_next = "unsupported model: no such directory /nope"
        chat_screen(app).action_load_model("/nope")
        await settle(pilot)
        assert any("Cannot load /nope" in n for n in notes(app, "error"))
        assert engine.model_name == "demo"
        assert not chat_screen(app).query_one(ActivityBar).has_class("-active")


async def test_clear_error_is_a_notification(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        engine.clear_error = OSError(28, "No space left on device")
        await pilot.press("f6", "y")
        await settle(pilot)
        assert any("No space left" in n for n in notes(app, "error"))


async def test_disk_full_and_memory_pressure_in_stats_become_notifications(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        engine.ssd_errors = 1
        engine.memory_level = "hard"
        app.poll_stats()
        await settle(pilot)
        assert any("SSD tier write failed" in n and "ENOSPC" in n for n in notes(app, "error"))
        assert any("Memory pressure hard" in n for n in notes(app))
        count = len(app._notifications)
        app.poll_stats()  # the same snapshot again: no repeat
        assert len(app._notifications) == count


async def test_a_raising_engine_call_never_crashes(make_app, engine):
    app = make_app()

    def broken_submit(*args, **kwargs):
        raise RuntimeError("engine is closed")

    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        engine.submit = broken_submit
        await send(pilot, "hello?")
        assert any("engine is closed" in n for n in notes(app, "error"))
        assert not chat_screen(app).streaming


async def test_reopening_after_a_restart_shows_the_whole_conversation(
    tmp_path: Path, make_app, settings
):
    db = tmp_path / "chat.sqlite"
    store = ConversationStore(db, clock=fixed_clock)
    engine = FlakyEngine("demo")
    app = make_app(engine=engine, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first")
        await send(pilot, "second")
        await pilot.press("ctrl+r")
        await settle(pilot)
    engine.close()
    store.close()

    store = ConversationStore(db, clock=fixed_clock)
    engine = FlakyEngine("demo")
    app = make_app(engine=engine, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        views = chat_screen(app).query_one(Transcript).views
        assert [v.info.content for v in views] == [
            "first",
            "Reply 1 to: first",
            "second",
            "Reply 3 to: second",
        ]
        assert (views[-1].info.index, views[-1].info.count) == (1, 2)
        assert views[-1].info.metrics is not None  # metrics come back from the store
        await send(pilot, "third")
        assert len(shown(app)) == 6
        # the new turn's prompt holds the whole conversation
        assert "second" in engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    engine.close()
    store.close()


async def test_prefill_progress_is_shown_then_hidden(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        screen = chat_screen(app)
        bar = screen.query_one(ActivityBar)
        engine.prefill_gate.clear()
        screen.query_one(ChatInput).insert("prefill me")
        await pilot.press("enter")
        for _ in range(300):
            await pilot.pause()
            if bar.has_class("-active"):
                break
        assert bar.has_class("-active")
        assert bar.label.startswith("prefill 0/")
        # the first chunk is running: an indeterminate bar, not one stuck at 0%
        assert bar.label.endswith("first chunk running")
        assert bar.query_one(ProgressBar).total is None
        engine.prefill_gate.set()
        await settle(pilot)
        assert not bar.has_class("-active")


async def test_unsupported_model_panels_say_na_with_the_reason(make_app):
    engine = FlakyEngine("odd-model", supported=False)
    app = make_app(engine=engine)
    async with app.run_test(size=WIDE) as pilot:  # the panels show from 140 columns
        await send(pilot, "hello")
        panels = chat_screen(app).query_one(CachePanels)
        tails = panels.query_one("#tails-panel")
        assert tails.has_class("-off")
        assert "N/A" in str(tails.query_one(".na").content)
        assert "unsupported layer kind" in str(tails.query_one(".na").content)
        assert panels.query_one("#hot-panel").has_class("-off")
        assert any("Cache off" in n for n in notes(app))
    engine.close()


async def test_panels_follow_the_cache_after_hits(make_app):
    app = make_app()
    async with app.run_test(size=WIDE) as pilot:
        await send(pilot, "the same long question about caches")
        await pilot.press("ctrl+r")
        await settle(pilot)
        stats = chat_screen(app).query_one(CachePanels).stats
        assert stats.resident.hits > 0  # the regenerate: the same prompt again
        assert stats.last_turn.cached_tokens == stats.last_turn.prompt_tokens
        reply = chat_screen(app).query_one(Transcript).views[-1]
        assert "cached 0/" not in str(reply.query_one(".metrics").content)


async def test_app_loads_the_configured_model_when_the_engine_has_none(make_app, settings):
    engine = FlakyEngine("")
    app = make_app(engine=engine)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert engine.model_name == settings.model
    engine.close()


async def test_unknown_keymap_ids_are_reported(make_app, settings):
    settings.keymap = {"no_such_action": "ctrl+z"}
    app = make_app(settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert any("no_such_action" in n for n in notes(app, "warning"))


def test_importing_the_tui_with_a_fake_engine_does_not_import_mlx():
    tests = Path(__file__).resolve().parents[1]
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tests)!r})
        from fakes import FakeEngine
        from tierchat.core.chat.store import ConversationStore
        from tierchat.config.settings import Settings
        from tierchat.tui.app import TierchatApp
        engine = FakeEngine("demo")
        TierchatApp(engine, ConversationStore(":memory:"), Settings())
        engine.close()
        assert "mlx" not in sys.modules, "mlx was imported"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
