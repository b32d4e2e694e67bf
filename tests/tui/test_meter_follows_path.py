"""Issue 40: the context the input's border shows follows the path on screen: after a
swipe to a shorter branch, an edit of an earlier turn and opening a chat from search, it
is the count of the path shown, never the one shown before."""

from __future__ import annotations

import pytest
from tierchat.core.chat.draft import count_draft
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.transcript import Transcript
from tui_kit import SIZE, chat_screen, send, settle, wait_for

pytestmark = pytest.mark.anyio


def context_shown(app) -> str:
    return chat_screen(app).query_one(ChatInput).border_subtitle


async def meter_follows(pilot, what: str) -> None:
    """Wait until the border shows the context of the path shown (the count a fresh
    ``count_draft`` of the empty input gives); stale, it never does."""
    app = pilot.app
    screen = chat_screen(app)

    def current() -> bool:
        count = screen.pane.draft_meter.count
        expected = count_draft(app.session, "")
        return count == expected and context_shown(app).startswith(
            f"context {expected.prompt_tokens:,} "
        )

    await settle(pilot)
    await wait_for(pilot, current, timeout=10, what=f"the meter after {what}")


async def long_chat(pilot) -> None:
    await send(pilot, "a first question about lighthouses and their keepers")
    await send(pilot, "a second question, longer, about bridges and tunnels and ferries")
    await send(pilot, "a third one about canals")
    await meter_follows(pilot, "three turns")


async def test_meter_follows_an_edit_and_a_swipe_to_a_shorter_branch(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await long_chat(pilot)
        long_path = count_draft(app.session, "").prompt_tokens
        await pilot.press("escape", "home", "e")  # edit the first question
        app.screen.query_one("#edit-area").load_text("short")
        await pilot.press("ctrl+s")
        await meter_follows(pilot, "an edit of the first turn")
        assert count_draft(app.session, "").prompt_tokens < long_path
        screen = chat_screen(app)
        screen.query_one(Transcript).focus()
        screen.pane.selected = 0
        await pilot.press("left")  # back to the long branch
        await meter_follows(pilot, "a swipe to the long branch")
        assert screen.pane.draft_meter.count.prompt_tokens == long_path
        await pilot.press("right")  # and to the short one again
        await meter_follows(pilot, "a swipe to the short branch")
        assert screen.pane.draft_meter.count.prompt_tokens < long_path


async def test_meter_follows_a_chat_opened_from_search(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "short chat about owls")
        await pilot.press("ctrl+n")
        await long_chat(pilot)
        await pilot.press("ctrl+f")
        await pilot.press(*"owls")
        await pilot.press("ctrl+t")  # every conversation
        await wait_for(pilot, lambda: getattr(app.screen, "hits", None), what="a hit")
        await pilot.press("enter")
        await meter_follows(pilot, "opening the short chat from search")
        assert chat_screen(app).query_one(Transcript).views[0].info.content == (
            "short chat about owls"
        )
