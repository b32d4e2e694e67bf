"""Pilot tests: a conversation's title follows its first message kept. A first message
the session withdraws (its turn failed) takes its title with it; a conversation made by
a settings save (Ctrl+N, then F9) is untitled until its first message, which titles it;
a title the user chose stays."""

from __future__ import annotations

import pytest
from tierchat.tui.screens.conversation_settings import ConversationSettingsScreen
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.conversation_list import ConversationList
from tui_kit import SIZE, chat_screen, send, settle

pytestmark = pytest.mark.anyio


def listed(app) -> list[str]:
    """The conversation list's rows as shown (title line, then date)."""
    listing = chat_screen(app).query_one(ConversationList)
    return [
        str(listing.get_option_at_index(i).prompt).split("\n")[0]
        for i in range(listing.option_count)
    ]


def title(app, store) -> str | None:
    return store.get_conversation(chat_screen(app).conversation_id).title


async def test_a_withdrawn_first_message_takes_its_title_with_it(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        engine.fail_next = "prefill refused: needs 9.1 GiB, limit 8.0 GiB"
        await send(pilot, "a question that never got an answer")
        await settle(pilot)
        screen = chat_screen(app)
        box = screen.query_one(ChatInput)
        assert box.text == "a question that never got an answer"  # withdrawn
        assert title(app, store) is None
        assert listed(app) == ["● untitled"]
        assert "never got an answer" not in screen.sub_title
        box.clear()
        await send(pilot, "the first message kept")
        assert title(app, store) == "the first message kept"
        assert listed(app) == ["● the first message kept"]
        assert screen.sub_title.endswith(" · the first message kept")


async def test_a_chat_made_by_a_settings_save_is_titled_by_its_first_message(
    make_app, engine, store
):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "an older chat")
        await pilot.press("ctrl+n")
        await pilot.press("f9")
        dialog = app.screen
        assert isinstance(dialog, ConversationSettingsScreen)
        dialog.query_one("#temperature").value = "0.7"
        await pilot.press("ctrl+s")
        await settle(pilot)
        screen = chat_screen(app)
        assert screen.conversation_id is not None and title(app, store) is None
        await send(pilot, "tell me about prefix caches")
        assert title(app, store) == "tell me about prefix caches"
        assert "● tell me about prefix caches" in listed(app)
        assert store.conversation_settings(screen.conversation_id)["temperature"] == 0.7
        await send(pilot, "a second message")  # only the first one titles it
        assert title(app, store) == "tell me about prefix caches"


async def test_a_title_the_user_chose_stays(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first")
        cid = chat_screen(app).conversation_id
        store.rename(cid, "my notes")
        engine.fail_next = "engine exploded"
        await send(pilot, "this one fails")
        await settle(pilot)
        assert store.get_conversation(cid).title == "my notes"
