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
from tui_kit import SIZE, chat_screen, enter, settle

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
