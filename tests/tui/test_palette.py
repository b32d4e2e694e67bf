"""Pilot tests: every command palette command runs the same action as its key."""

from __future__ import annotations

import pytest
from tierchat.tui.commands import (
    BRANCH_COMMANDS,
    CACHE_COMMANDS,
    CONVERSATION_COMMANDS,
    TOOL_COMMANDS,
)
from tierchat.tui.screens.confirm import ConfirmScreen
from tierchat.tui.screens.help import HelpScreen
from tierchat.tui.screens.model_picker import ModelPickerScreen
from tierchat.tui.screens.prompt import EditMessageScreen, PromptScreen
from tierchat.tui.widgets.cache_panels import CachePanels
from tierchat.tui.widgets.conversation_list import ConversationList
from tierchat.tui.widgets.transcript import Transcript
from tui_kit import SIZE, chat_screen, send, settle

pytestmark = pytest.mark.anyio


async def type_query(pilot, text: str) -> None:
    """Open the palette and enter ``text`` as one edit (one search, not one per key)."""
    from textual.command import CommandInput

    await pilot.press("ctrl+p")
    pilot.app.screen.query_one(CommandInput).value = text
    await pilot.pause(0.05)  # the palette searches in a worker
    await settle_palette(pilot)


async def run_command(pilot, title: str) -> None:
    """Open the palette, type ``title``, run the highlighted (best) hit."""
    await type_query(pilot, title)
    await pilot.press("enter")
    await settle(pilot)


async def settle_palette(pilot) -> None:
    from textual.command import CommandPalette

    palette = pilot.app.screen
    assert isinstance(palette, CommandPalette)
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
    highlighted = palette.query_one("CommandList").highlighted
    assert highlighted is not None, "no command matched"


def last_reply(app):
    return chat_screen(app).query_one(Transcript).views[-1].info


async def test_palette_lists_cache_commands(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await type_query(pilot, "Cache: clear")
        prompts = [str(o.prompt) for o in app.screen.query_one("CommandList").options]
        for title in ("clear hot tier", "clear SSD tier", "clear tails", "clear all"):
            assert any(title in p for p in prompts), prompts


async def test_cache_clear_commands_confirm_and_clear(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "something to cache, long enough for a block or two")
        clears = [c for c in CACHE_COMMANDS if c.action.startswith("clear")]
        assert len(clears) == 4
        for command in clears:
            await run_command(pilot, command.title)
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await settle(pilot)
        assert engine.cleared == ["hot", "ssd", "tails", "all"]


async def test_cache_toggle_panels_command(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        panels = chat_screen(app).query_one(CachePanels)
        shown = panels.display  # narrow: folded by default
        await run_command(pilot, "Cache: toggle panels")
        await pilot.pause()
        assert panels.display is not shown


async def test_branch_commands(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "question")
        await run_command(pilot, "Branch: regenerate reply")
        assert (last_reply(app).index, last_reply(app).count) == (1, 2)
        await run_command(pilot, "Branch: previous")
        assert last_reply(app).index == 0
        await run_command(pilot, "Branch: next")
        assert last_reply(app).index == 1
        await run_command(pilot, "Chat: copy message")
        assert app.clipboard == "Reply 2 to: question"
        await run_command(pilot, "Branch: edit message")
        assert isinstance(app.screen, EditMessageScreen)
        await pilot.press("escape")
        await run_command(pilot, "Branch: fork conversation")
        assert len(store.list_conversations()) == 2


async def test_stop_command_is_offered_only_while_streaming(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        screen = chat_screen(app)
        engine.gate.clear()
        from tierchat.tui.widgets.chat_input import ChatInput

        screen.query_one(ChatInput).insert("tell me more")
        await pilot.press("enter")
        for _ in range(300):
            await pilot.pause()
            if (
                screen.streaming
                and screen.pane.turns.stream_view
                and screen.pane.turns.stream_view.text
            ):
                break
        await run_command(pilot, "Chat: stop generation")
        engine.gate.set()
        await settle(pilot)
        assert any("stopped" in n.message for n in app._notifications)


async def test_conversation_commands(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first chat")
        first = chat_screen(app).conversation_id
        await run_command(pilot, "Conversation: rename")
        assert isinstance(app.screen, PromptScreen)
        await pilot.press("escape")
        await run_command(pilot, "Conversation: new")
        assert chat_screen(app).conversation_id is None
        await run_command(pilot, "Open: first chat")
        assert chat_screen(app).conversation_id == first
        await run_command(pilot, "Conversation: toggle list")
        assert not chat_screen(app).query_one(ConversationList).display
        await run_command(pilot, "Conversation: delete")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await settle(pilot)
        assert store.list_conversations() == []


async def test_help_command(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await run_command(pilot, "Help: keys")
        assert isinstance(app.screen, HelpScreen)


async def test_model_commands(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await run_command(pilot, "Model: pick…")
        assert isinstance(app.screen, ModelPickerScreen)
        await pilot.press("escape")
        await run_command(pilot, "Model: load demo-gemma")
        assert engine.model_name == "demo-gemma"


def test_every_screen_action_has_a_palette_command():
    from textual.actions import parse
    from tierchat.tui.screens.chat import ChatScreen
    from tierchat.tui.screens.chat.pane import MessagePane

    commanded = {c.action.split("(")[0] for c in CACHE_COMMANDS + BRANCH_COMMANDS}
    commanded |= {c.action.split("(")[0] for c in CONVERSATION_COMMANDS + TOOL_COMMANDS}
    keyed = {parse(b.action)[1] for b in ChatScreen.BINDINGS + MessagePane.BINDINGS}
    # moving the cursor and going back to the input are keys, not commands
    keyed -= {"select", "select_edge", "focus_input"}
    assert keyed <= commanded | {"pick_model"}
