"""Replies of several conversations in flight at once (docs/DESIGN.md §16): a reply keeps
streaming while the user opens another conversation and sends there; opening it again
shows the reply as far as it went; Esc stops the reply of the conversation shown only.

On the fake engine (one worker: the second request waits behind the first, held by
``gate``) for the UI's behaviour; ``test_real_engine_many_turns.py`` checks the replies
against the same requests run alone on the real engine.
"""

from __future__ import annotations

import pytest
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.transcript import Transcript
from tui_kit import SIZE, chat_screen, enter, settle, wait_for

pytestmark = pytest.mark.anyio


def contents(store, cid) -> list[tuple[str, str]]:
    return [(n.role, n.content) for n in store.active_path(cid)]


async def start_two(pilot, engine):
    """Send in A (held after its first token batch), then in a new conversation B.
    Returns ``(a, b)``."""
    screen = chat_screen(pilot.app)
    await settle(pilot)
    engine.gate.clear()
    await enter(pilot, "first question")
    await wait_for(pilot, lambda: bool(screen.pane.turns.stream_view and screen.pane.turns.stream_view.text))
    a = screen.conversation_id
    await pilot.press("ctrl+n")  # allowed while A's reply streams
    assert screen.conversation_id is None and not screen.streaming
    assert screen.pane.turns.streaming(a)
    await enter(pilot, "second question")
    await wait_for(pilot, lambda: screen.conversation_id not in (None, a) and screen.streaming)
    b = screen.conversation_id
    assert set(screen.pane.turns.turns) == {a, b}
    return a, b


async def test_switching_back_shows_the_reply_that_went_on(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = chat_screen(app)
        a, b = await start_two(pilot, engine)
        screen.action_open_conversation(a)
        await wait_for(pilot, lambda: screen.conversation_id == a and screen.streaming)
        await wait_for(
            pilot, lambda: bool(screen.pane.turns.stream_view and screen.pane.turns.stream_view.text)
        )
        shown = screen.query_one(Transcript).views
        assert [v.info.role for v in shown] == ["user", "assistant"]
        assert shown[-1].info.node_id is None  # the placeholder, streaming
        assert "Reply 1 to: first question".startswith(shown[-1].text)
        engine.gate.set()
        await settle(pilot)
        # both replies complete and stored, each in its own conversation
        assert contents(store, a) == [
            ("user", "first question"),
            ("assistant", "Reply 1 to: first question"),
        ]
        assert contents(store, b) == [
            ("user", "second question"),
            ("assistant", "Reply 2 to: second question"),
        ]
        # A is shown as stored; B, opened again, too
        shown = screen.query_one(Transcript).views
        assert [(v.info.role, v.info.content) for v in shown] == contents(store, a)
        assert shown[-1].info.node_id is not None
        screen.action_open_conversation(b)
        await settle(pilot)
        shown = screen.query_one(Transcript).views
        assert [(v.info.role, v.info.content) for v in shown] == contents(store, b)
        assert not screen.pane.turns.turns and not screen.streaming


async def test_esc_stops_the_reply_of_the_conversation_shown_only(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = chat_screen(app)
        a, b = await start_two(pilot, engine)
        await pilot.press("escape")  # B is shown: B stops
        turn_a, turn_b = screen.pane.turns.turns[a], screen.pane.turns.turns[b]
        assert turn_b.handle.cancelled and turn_b.stopping
        assert not turn_a.handle.cancelled  # A goes on
        # the fake engine serves one request at a time: B ends when the worker reaches it
        engine.gate.set()
        await settle(pilot)
        # nothing of B was generated: its message is dropped and given back to the input
        assert contents(store, b) == []
        assert screen.conversation_id == b
        assert screen.query_one(ChatInput).text == "second question"
        assert contents(store, a) == [
            ("user", "first question"),
            ("assistant", "Reply 1 to: first question"),
        ]
        meta = store.active_path(a)[-1].meta
        assert meta["finish_reason"] == "stop"


async def test_a_conversation_with_a_reply_in_flight_cannot_be_deleted(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = chat_screen(app)
        a, b = await start_two(pilot, engine)
        screen.action_open_conversation(a)
        await wait_for(pilot, lambda: screen.conversation_id == a)
        assert screen.check_action("delete_conversation", ()) is None
        assert screen.check_action("pick_model", ()) is None  # not under replies in flight
        engine.gate.set()
        await settle(pilot)
        assert screen.check_action("delete_conversation", ()) is True
        assert screen.check_action("pick_model", ()) is True


async def test_a_message_dropped_in_another_conversation_comes_back_there(
    make_app, engine, store
):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = chat_screen(app)
        await settle(pilot)
        engine.prefill_gate.clear()  # A's prefill holds after its first progress event
        await enter(pilot, "lost question")
        await wait_for(pilot, lambda: screen.streaming, what="A's turn")
        a = screen.conversation_id
        await pilot.press("ctrl+n")
        box = screen.query_one(ChatInput)
        assert box.text == ""
        screen.pane.turns.turns[a].handle.cancel()  # A ends before any token, while not shown
        engine.prefill_gate.set()
        await settle(pilot)
        assert contents(store, a) == []  # the session dropped the message...
        assert box.text == ""  # ...and the input of the conversation shown keeps its own
        screen.action_open_conversation(a)
        await wait_for(pilot, lambda: box.text == "lost question", what="the text back in A")
