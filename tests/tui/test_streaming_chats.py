"""Conversations with a reply in flight (docs/DESIGN.md §16), on the fake engine: the
conversation list marks each one whose reply still streams, and the mark goes when the
reply ends, fails or is stopped; opening a streaming conversation again shows its
partial reply at once, mounted with its messages, before any new token arrives.

The engine's ``gate`` holds a reply after its first token batch, so "before any new
token" is a fact of the test, not a race."""

from __future__ import annotations

import pytest
from test_many_turns import start_two
from tierchat.tui.widgets.conversation_list import STREAMING_MARK, ConversationList
from tierchat.tui.widgets.transcript import MessageView, Transcript
from tui_kit import SIZE, chat_screen, enter, settle, wait_for

pytestmark = pytest.mark.anyio


def marked(screen) -> set[int]:
    """The conversations whose row shows the streaming mark."""
    listing = screen.query_one(ConversationList)
    return {
        row.id
        for row in listing.rows
        if f" {STREAMING_MARK}" in str(listing.get_option(str(row.id)).prompt)
    }


async def test_the_list_marks_streaming_conversations_until_their_reply_ends(
    make_app, engine, store
):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = chat_screen(app)
        a, b = await start_two(pilot, engine)
        assert marked(screen) == {a, b}
        await pilot.press("escape")  # B (shown) stops; its reply never started
        engine.gate.set()
        await settle(pilot)
        assert marked(screen) == set()  # A finished, B stopped
        # a failed reply loses its mark too
        engine.fail_next = "boom"
        await enter(pilot, "once more")
        await settle(pilot)
        assert any(n.title == "Engine error" for n in app._notifications)
        assert marked(screen) == set()
        # the open conversation's own mark stays
        listing = screen.query_one(ConversationList)
        assert str(listing.get_option(str(b)).prompt).startswith("●")


async def test_a_streaming_conversation_shows_its_partial_reply_at_once(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = chat_screen(app)
        a, b = await start_two(pilot, engine)
        turn = screen.pane.turns.turns[a]
        partial = turn.text
        assert partial and "Reply 1 to: first question".startswith(partial)
        streamed = len(engine.requests), turn.text
        transcript = screen.query_one(Transcript)
        mounts: list[list[MessageView]] = []
        mount_all = transcript.mount_all

        def spy(widgets, *args, **kwargs):
            mounts.append([w for w in widgets if isinstance(w, MessageView)])
            return mount_all(widgets, *args, **kwargs)

        transcript.mount_all = spy  # type: ignore[method-assign]
        screen.action_open_conversation(a)
        await screen.pane.synced()
        views = transcript.views
        assert [v.info.role for v in views] == ["user", "assistant"]
        reply = views[-1]
        assert reply.info.node_id is None and reply.has_class("-streaming")
        # the partial reply is in the very mount that shows A's messages, with its text
        assert mounts and mounts[-1] == views, mounts
        assert reply.markdown.source == partial
        assert (len(engine.requests), turn.text) == streamed  # no new token meanwhile
        assert screen.pane.turns.stream_view is reply
        # the next tokens extend the text mounted (not replace it)
        await reply.stream_to(partial + "…more")
        await wait_for(pilot, lambda: reply.markdown.source == partial + "…more")
        # and the stream goes on from there
        engine.gate.set()
        await settle(pilot)
        shown = transcript.views
        assert shown[-1].info.content == "Reply 1 to: first question"
        assert store.active_path(a)[-1].content == "Reply 1 to: first question"
