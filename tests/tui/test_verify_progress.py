"""Verify against cold shows its progress and stops (docs/DESIGN.md §16, §18), on the fake
engine: while the three teacher-forced runs go, the activity bar reads "verify n/N";
Esc (the stop key of a streaming reply) stops it, a notification says so and nothing is
stored; a second ``V`` while one runs says one is running. The engine's ``gate`` holds
each run after its first token batch, so the verify is caught mid-run without sleeps."""

from __future__ import annotations

import pytest
from tierchat.tui.widgets.activity import ActivityBar
from tui_kit import SIZE, chat_screen, send, settle, wait_for

pytestmark = pytest.mark.anyio


async def start_verify(pilot, engine):
    """A reply, the cursor on it, the engine held, ``V``: the verify's first run waits
    after its first batch. Returns the chat screen."""
    screen = chat_screen(pilot.app)
    await send(pilot, "hello")
    await pilot.press("alt+up")  # the message cursor on the last message: the reply
    await pilot.pause()
    engine.gate.clear()
    await pilot.press("V")
    await wait_for(pilot, lambda: "verify" in screen.pane.query_one(ActivityBar).label)
    return screen


async def test_verify_shows_progress_and_esc_stops_it(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await start_verify(pilot, engine)
        bar = screen.pane.query_one(ActivityBar)
        assert bar.has_class("-active")
        label = bar.label
        assert label.startswith("verify ") and "through the cache" in label, label
        done, total = label.split()[1].split("/")
        assert 0 < int(done) < int(total)
        assert screen.pane.verifying and screen.check_action("stop", ()) is True
        before = len(engine.requests)
        await pilot.press("V")  # a second one while it runs
        await pilot.pause()
        assert any("A verify is running" in n.message for n in app._notifications)
        assert len(engine.requests) == before  # no second verify started
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.pane.verifying, what="the verify to stop")
        await settle(pilot)
        assert any(n.title == "Verify stopped" for n in app._notifications)
        assert not bar.has_class("-active")
        assert len(engine.requests) == before  # the cold runs never started
        reply = store.active_path(screen.conversation_id)[-1]
        assert "verify" not in (reply.meta or {})
        assert screen.check_action("stop", ()) is None


async def test_a_verify_runs_to_its_report_with_progress_to_the_end(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await start_verify(pilot, engine)
        bar = screen.pane.query_one(ActivityBar)
        engine.gate.set()
        await wait_for(pilot, lambda: not screen.pane.verifying, what="the verify's end")
        await settle(pilot)
        assert any(n.title == "Verify against cold" and "top-1" in n.message
                   for n in app._notifications)  # fmt: skip
        reply = store.active_path(screen.conversation_id)[-1]
        assert reply.meta["verify"]["cached"]["positions"] > 0
        assert not bar.has_class("-active")
        assert len(engine.requests) == 4  # the reply, then the cached and two cold runs
        assert [r.use_cache for r in engine.requests[1:]] == [True, False, False]


def test_verify_progress_and_stop_keys_in_tmux(tmp_path):
    """With real key bytes in tmux: ``V`` shows "verify n/N" on screen, Esc (``ESC``) and
    Ctrl+C (``0x03``) each run the stop and the screen says "Verify stopped"; the app
    stays and nothing is stored with the reply."""
    from test_terminal_keys import TmuxTerminal

    term = TmuxTerminal(tmp_path, args=("--token-delay", "1.0"))  # each run: ~4 s
    try:
        term.write(b"hi\r")
        term.wait_for(lambda r: r.get("streaming") is False, "the reply")
        term.press("alt+up", "select(-1)")  # the message cursor on the reply
        for stop in (b"\x1b", b"\x03"):
            term.press("V", "verify_turn")
            term.until(lambda: "verify " in term.screen() and "Esc stops" in term.screen(),
                       "the verify's progress")  # fmt: skip
            term.write(stop)
            record = term.wait_for(lambda r: r.get("action") == "stop", f"{stop!r} -> stop")
            assert record["ok"], record
            term.until(lambda: "Verify stopped" in term.screen(), "the stop's notification")
            term.until(lambda: "verify " not in term.screen(), "the activity bar hidden")
            assert term.proc.poll() is None
            assert "Do you want to quit" not in term.screen()
        stored = term.rows("SELECT meta FROM nodes WHERE role='assistant'")
        assert len(stored) == 1 and '"verify"' not in (stored[0][0] or "")
    finally:
        term.close()
