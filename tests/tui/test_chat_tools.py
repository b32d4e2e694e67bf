"""Pilot tests for the daily tools of the chat screen (screens/chat/tools.py): search
(key and palette, across conversations, opening at the message), the raw text of a
message, copying one code block, long prompts ($EDITOR, clear, the live token count),
deleting a message or a branch, importing an export."""

from __future__ import annotations

import json
import stat
import sys

import pytest
from test_palette import run_command, type_query
from textual.widgets import Input, OptionList, TextArea
from tierchat.core.chat.draft import count_draft
from tierchat.tui.commands import TOOL_COMMANDS
from tierchat.tui.draft_meter import DEBOUNCE_S
from tierchat.tui.screens.code_blocks import CodeBlocksScreen
from tierchat.tui.screens.confirm import ConfirmScreen
from tierchat.tui.screens.prompt import PromptScreen
from tierchat.tui.screens.raw_message import RawMessageScreen
from tierchat.tui.screens.search import SearchScreen
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.transcript import Transcript
from tui_kit import SIZE, chat_screen, send, settle

pytestmark = pytest.mark.anyio

USER_TEXT = "In HTML, what does <br> do? compute 2*3*4\nline two\n  indented"
TWO_BLOCKS = "Two scripts:\n```python\nprint(2 * 3)\n```\nand\n~~~sh\nls -la\n~~~"


def shown(app) -> list[str]:
    return [v.info.content for v in chat_screen(app).query_one(Transcript).views]


def notes(app, severity: str | None = None) -> list[str]:
    return [
        f"{n.title}: {n.message}"
        for n in app._notifications
        if severity is None or n.severity == severity
    ]


def old_chat(store, title: str, turns: int, word_at: int | None = None) -> tuple[int, int]:
    """A stored conversation of ``turns`` user/assistant pairs; the user message of turn
    ``word_at`` holds the word "zanzibar". Returns (conversation id, that node's id)."""
    cid = store.create_conversation(title)
    parent, target = None, 0
    for i in range(turns):
        text = f"question {i} about zanzibar" if i == word_at else f"question {i}"
        user = store.add_node(cid, parent, "user", text)
        if i == word_at:
            target = user.id
        parent = store.add_node(cid, user.id, "assistant", f"answer {i}").id
    return cid, target


async def on_message(pilot, index: int) -> None:
    """Put the message cursor on message ``index`` (negative: from the end)."""
    screen = chat_screen(pilot.app)
    screen.query_one(Transcript).focus()
    await pilot.pause()
    views = screen.query_one(Transcript).views
    screen.pane.selected = index % len(views)
    await pilot.pause()


# ---------------------------------------------------------------- search


async def test_search_key_finds_an_old_message_in_another_conversation(make_app, store):
    old, target = old_chat(store, "long ago", 30, word_at=2)  # 60 messages: beyond the window
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+n")
        await send(pilot, "a new chat about something else")
        screen = chat_screen(app)
        assert screen.conversation_id != old
        await pilot.press("ctrl+f")
        assert isinstance(app.screen, SearchScreen) and app.screen.scope == "here"
        await pilot.press(*"zanzib")
        assert app.screen.hits == []  # not in this conversation
        await pilot.press("ctrl+t")  # all conversations
        assert [h.node_id for h in app.screen.hits] == [target]
        await pilot.press("enter")
        await settle(pilot)
        assert screen.conversation_id == old
        views = screen.query_one(Transcript).views
        assert screen.pane.selected is not None
        assert views[screen.pane.selected].info.node_id == target
        assert screen.query_one(Transcript).has_focus


async def test_a_found_message_on_another_branch_becomes_the_active_path(make_app, store):
    cid, target = old_chat(store, "branched", 3, word_at=1)
    first_user = store.active_path(cid)[0]
    store.add_node(cid, None, "user", "an edited first question")  # selected root now
    assert target not in [n.id for n in store.active_path(cid)]
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+f")
        await pilot.press(*"zanzibar", "enter")
        await settle(pilot)
        path = [n.id for n in store.active_path(cid)]
        assert first_user.id in path and target in path
        assert any("another branch" in n for n in notes(app))


async def test_palette_finds_a_conversation_by_a_word_of_an_old_message(make_app, store):
    old, target = old_chat(store, "kept for later", 4, word_at=0)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+n")
        await send(pilot, "another chat")
        await type_query(pilot, "zanzibar")
        prompts = [str(o.prompt) for o in app.screen.query_one("CommandList").options]
        assert any("Found in kept for later" in p for p in prompts), prompts
        await pilot.press("enter")
        await settle(pilot)
        screen = chat_screen(app)
        assert screen.conversation_id == old
        assert screen.query_one(Transcript).views[screen.pane.selected].info.node_id == target


async def test_search_rows_tell_a_reply_from_its_continued_sibling(make_app, store):
    # a reply cut at max tokens and its continued sibling hold the same words and were
    # stored in the same minute: the rows must still differ (swipe n/m, length)
    cid = store.create_conversation("cut")
    user = store.add_node(cid, None, "user", "tell me about zanzibar")
    cut = store.add_node(cid, user.id, "assistant", "Zanzibar is an", token_ids=[1, 2, 3])
    grown = store.add_node(
        cid,
        user.id,
        "assistant",
        "Zanzibar is an island off Tanzania.",
        token_ids=[1, 2, 3, 4, 5, 6],
        meta={"continued_from": cut.id},
    )
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+f")
        await pilot.press(*"zanzibar")
        screen = app.screen
        assert isinstance(screen, SearchScreen)
        results = screen.query_one(OptionList)
        heads = {
            int(results.get_option_at_index(i).id): str(results.get_option_at_index(i).prompt)
            for i in range(results.option_count)
        }
        heads = {nid: text.split("\n")[0] for nid, text in heads.items()}
        assert heads[cut.id] == "assistant · swipe 1/2 · 3 tokens · 2026-01-01 00:00"
        assert heads[grown.id] == "assistant · swipe 2/2 · 6 tokens · 2026-01-01 00:00"
        assert heads[user.id] == "you · 22 chars · 2026-01-01 00:00"  # no ids kept: characters


# ---------------------------------------------------------------- one message


async def test_raw_view_shows_the_stored_text_exactly(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, USER_TEXT)
        await on_message(pilot, -2)
        await pilot.press("v")
        assert isinstance(app.screen, RawMessageScreen)
        area = app.screen.query_one(TextArea)
        assert area.text == USER_TEXT and area.read_only
        await pilot.press("a")
        assert app.clipboard == USER_TEXT
        await pilot.press("escape")
        assert not isinstance(app.screen, RawMessageScreen)


async def test_copy_one_code_block_from_a_list_or_at_once(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, TWO_BLOCKS)
        await on_message(pilot, -2)
        await pilot.press("y")
        assert isinstance(app.screen, CodeBlocksScreen)
        assert len(app.screen.query_one(OptionList).options) == 2
        await pilot.press("2")
        assert app.clipboard == "ls -la"
        await pilot.press("y", "enter")  # the first one, highlighted
        assert app.clipboard == "print(2 * 3)"
        await pilot.press("i")
        await send(pilot, "```\nonly one\n```")
        await on_message(pilot, -2)
        await pilot.press("y")  # one block: copied without a list
        assert not isinstance(app.screen, CodeBlocksScreen)
        assert app.clipboard == "only one"
        await pilot.press("i")
        await send(pilot, "plain words")
        await on_message(pilot, -1)
        assert chat_screen(app).pane.check_action("copy_code", ()) is None  # no fence: dimmed


# ---------------------------------------------------------------- long prompts


def editor_script(tmp_path, text: str) -> str:
    path = tmp_path / "editor.py"
    path.write_text(
        f"#!{sys.executable}\nimport sys\n"
        f"old = open(sys.argv[1]).read()\n"
        f"open(sys.argv[1], 'w').write(old + {text!r} + '\\n')\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


async def test_editor_clear_and_token_count(make_app, engine, tmp_path, monkeypatch):
    monkeypatch.setenv("VISUAL", editor_script(tmp_path, " and more\nfrom the editor"))
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        screen = chat_screen(app)
        box = screen.query_one(ChatInput)
        box.focus()
        await pilot.press(*"draft")
        await pilot.press("ctrl+g")
        assert box.text == "draft and more\nfrom the editor"
        assert box.cursor_location == box.document.end
        await pilot.pause(DEBOUNCE_S + 0.1)
        await settle(pilot)
        expected = count_draft(app.session, box.text)
        assert screen.pane.draft_meter.count == expected
        assert box.border_subtitle == (
            f"{expected.text_tokens} tokens · prompt {expected.prompt_tokens} / 4,096 (1%)"
        )
        engine.context_length = expected.prompt_tokens  # the draft fills the context
        await pilot.press("x")
        await pilot.pause(DEBOUNCE_S + 0.1)
        await settle(pilot)
        assert box.has_class("-over-limit") and "over the context" in box.border_subtitle
        await pilot.press("ctrl+l")
        # the draft's count goes at once; the context of the empty input follows after
        # the debounce (already, on a loaded machine)
        assert box.text == "" and not box.has_class("-over-limit")
        assert box.border_subtitle == "" or box.border_subtitle.startswith("context ")
        await pilot.pause(DEBOUNCE_S + 0.1)
        await settle(pilot)
        assert box.border_subtitle.startswith("context ") and "over" not in box.border_subtitle
        await pilot.press("ctrl+z")
        assert box.text.startswith("draft and more")


async def test_a_failing_editor_leaves_the_input(make_app, tmp_path, monkeypatch):
    monkeypatch.setenv("VISUAL", str(tmp_path / "missing-editor"))
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        box = chat_screen(app).query_one(ChatInput)
        box.insert("keep me")
        await pilot.press("ctrl+g")
        assert box.text == "keep me"
        assert any("cannot run the editor" in n for n in notes(app, "error"))


# ---------------------------------------------------------------- delete


async def test_delete_one_message_and_a_branch_confirmed(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "q0")
        await send(pilot, "q1")
        screen = chat_screen(app)
        cid = screen.conversation_id
        await on_message(pilot, 2)  # q1
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert len(store.active_path(cid)) == 4
        await pilot.press("d", "y")
        await settle(pilot)
        assert [n.content for n in store.active_path(cid)] == [
            "q0",
            "Reply 1 to: q0",
            "Reply 2 to: q1",
        ]
        assert shown(app) == ["q0", "Reply 1 to: q0", "Reply 2 to: q1"]
        await on_message(pilot, 1)  # the first reply: it and the one after it
        await pilot.press("D")
        assert isinstance(app.screen, ConfirmScreen)
        assert "1 message after it" in app.screen.body
        await pilot.press("y")
        await settle(pilot)
        assert [n.content for n in store.active_path(cid)] == ["q0"]
        assert shown(app) == ["q0"]


async def test_delete_message_with_two_replies_is_refused(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "q0")
        await pilot.press("ctrl+r")
        await settle(pilot)
        await on_message(pilot, 0)
        await pilot.press("d")
        assert not isinstance(app.screen, ConfirmScreen)
        assert any("2 branches" in n for n in notes(app, "warning"))


# ---------------------------------------------------------------- import


async def test_import_an_export_and_a_malformed_file(make_app, store, settings, tmp_path):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, USER_TEXT)
        await pilot.press("ctrl+r")
        await settle(pilot)
        screen = chat_screen(app)
        cid = screen.conversation_id
        await run_command(pilot, "Export: whole tree as JSON")
        (path,) = (settings.data_dir / "exports").glob("*.json")
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, PromptScreen)
        app.screen.query_one(Input).value = str(path)
        await pilot.press("enter")
        await settle(pilot)
        new = screen.conversation_id
        assert new != cid and len(store.list_conversations()) == 2
        old_nodes = [(n.role, n.content, n.token_ids) for n in store.active_path(cid)]
        assert [(n.role, n.content, n.token_ids) for n in store.active_path(new)] == old_nodes
        assert len(store.replies(store.user_turns(new)[0].id)) == 2

        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"format": "tierchat-conversation", "version": 1}))
        before = store.list_conversations()
        await pilot.press("ctrl+o")
        app.screen.query_one(Input).value = str(bad)
        await pilot.press("enter")
        await settle(pilot)
        assert store.list_conversations() == before
        assert screen.conversation_id == new
        errors = notes(app, "error")
        assert any(e.startswith("Import failed") and str(bad) in e for e in errors), errors


# ---------------------------------------------------------------- the palette


async def test_every_tool_command_runs_from_the_palette(make_app, tmp_path, monkeypatch):
    monkeypatch.setenv("VISUAL", editor_script(tmp_path, "!"))
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, TWO_BLOCKS)
        await on_message(pilot, 0)
        expected = {
            "search('here')": SearchScreen,
            "search('all')": SearchScreen,
            "raw_message": RawMessageScreen,
            "copy_code": CodeBlocksScreen,
            "delete_message": ConfirmScreen,
            "delete_branch": ConfirmScreen,
            "import_conversation": PromptScreen,
        }
        screen = chat_screen(app)
        for command in TOOL_COMMANDS:
            if command.action == "clear_input":
                screen.query_one(ChatInput).insert("to clear")
            if command.action == "undo_delete":  # offered once something was deleted
                reply = chat_screen(app).pane.path_infos()[-1].node_id
                app.trash.delete_branch(reply)
                nodes = len(app.store.active_path(screen.conversation_id))
            if command.action == "verify_turn":  # offered on a reply
                screen.pane.selected = 1
            await run_command(pilot, command.title)
            if command.action == "undo_delete":
                assert len(app.store.active_path(screen.conversation_id)) == nodes + 1
            if command.action in expected:
                assert isinstance(app.screen, expected[command.action]), command
                await pilot.press("escape")
                await pilot.pause()
            screen.pane.selected = 0
        box = screen.query_one(ChatInput)
        assert box.text == ""  # "!" from the editor, then cleared
        assert app.screen is screen


async def test_search_in_this_conversation_moves_the_cursor(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first about lighthouses")
        await send(pilot, "second about bridges")
        await send(pilot, "third about tunnels")
        screen = chat_screen(app)
        cid = screen.conversation_id
        await pilot.press("ctrl+f")
        await pilot.press(*"lighthouse")
        assert app.screen.scope == "here"
        hits = app.screen.hits
        assert len(hits) == 2  # the question and its reply ("Reply 1 to: …")
        await pilot.press("down", "enter")  # the second hit
        await settle(pilot)
        assert screen.conversation_id == cid and not notes(app, "warning")
        views = screen.query_one(Transcript).views
        assert views[screen.pane.selected].info.node_id == hits[1].node_id
        assert screen.pane.selected in (0, 1) and screen.query_one(Transcript).has_focus


async def test_the_count_waits_for_a_pause_in_typing(make_app, monkeypatch):
    from tierchat.tui import draft_meter

    calls: list[str] = []
    real = draft_meter.count_draft

    def counting(session, text):
        calls.append(text)
        return real(session, text)

    monkeypatch.setattr(draft_meter, "count_draft", counting)
    # a pause longer than a loaded machine takes between two of the keys below
    monkeypatch.setattr(draft_meter, "DEBOUNCE_S", 2.0)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        chat_screen(app).query_one(ChatInput).focus()
        await pilot.press(*"a burst of keys")
        assert calls == []  # nothing counted while typing
        await pilot.pause(draft_meter.DEBOUNCE_S + 0.3)
        await settle(pilot)
        assert calls == ["a burst of keys"]  # one count, of the whole draft
