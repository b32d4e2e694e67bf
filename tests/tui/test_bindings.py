"""Pilot tests: every key binding of the app, on the fake engine."""

from __future__ import annotations

import asyncio
import threading

import pytest
from tierchat.tui.app import BINDING_OWNERS, binding_ids
from tierchat.tui.screens.confirm import ConfirmScreen
from tierchat.tui.screens.help import HelpScreen
from tierchat.tui.screens.model_picker import ModelPickerScreen
from tierchat.tui.screens.prompt import EditMessageScreen, PromptScreen
from tierchat.tui.widgets.activity import ActivityBar
from tierchat.tui.widgets.cache_panels import CachePanels, CacheSummary
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.conversation_list import ConversationList
from tierchat.tui.widgets.transcript import MessageView, Transcript
from tui_kit import SIZE, WIDE, chat_screen, send, settle

pytestmark = pytest.mark.anyio


def views(app) -> list[MessageView]:
    return chat_screen(app).query_one(Transcript).views


def shown(app) -> list[tuple[str, str]]:
    return [(v.info.role, v.info.content) for v in views(app)]


async def wait_for(pilot, predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        await pilot.pause()
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_every_binding_has_an_id_and_ids_are_unique(anyio_backend):
    ids = binding_ids()
    assert len(ids) == len(set(ids))
    for _, owner in BINDING_OWNERS:
        for binding in owner.BINDINGS:
            assert binding.id, f"{owner.__name__} binding {binding.key} has no id"


async def test_help_lists_every_binding_id_and_closes(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        listed = {row[3] for row in app.screen.rows}
        assert set(binding_ids()) <= listed
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_send_streams_a_reply_and_stores_it(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hello there")
        assert shown(app) == [("user", "hello there"), ("assistant", "Reply 1 to: hello there")]
        (conv,) = store.list_conversations()
        assert conv.title == "hello there"
        path = store.active_path(conv.id)
        assert [n.role for n in path] == ["user", "assistant"]
        assert path[1].content == "Reply 1 to: hello there"
        metrics = views(app)[1].query_one(".metrics").content
        assert "prefilled" in str(metrics) and "TTFT" in str(metrics)
        assert chat_screen(app).query_one(ChatInput).text == ""


async def test_send_waits_for_keys_already_queued_for_the_input(make_app, engine):
    """Text + Enter in one terminal read: the app reads Enter (a priority binding) while
    the characters before it still wait in the input's queue. Send must see them."""
    from textual import events

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        box = chat_screen(app).query_one(ChatInput)
        for ch in "hi":
            box.post_message(events.Key(ch, ch))  # forwarded to the input, not yet handled
        box.action_send()  # what the Enter binding runs, before the input got to them
        await settle(pilot)
        assert shown(app)[0] == ("user", "hi")
        assert [r.prompt_ids for r in engine.requests]


async def test_enter_on_empty_input_sends_nothing(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("enter")
        await settle(pilot)
        assert engine.requests == []


async def test_newline_key_inserts_a_newline_without_sending(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("a", "ctrl+j", "b")
        assert chat_screen(app).query_one(ChatInput).text == "a\nb"
        assert engine.requests == []


async def test_keymap_from_settings_remaps_send_and_newline(make_app, settings, engine):
    settings.keymap = {"send": "ctrl+s", "newline": "enter"}
    app = make_app(settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("h", "i", "enter", "x")
        assert chat_screen(app).query_one(ChatInput).text == "hi\nx"
        assert engine.requests == []
        await pilot.press("ctrl+s")
        await settle(pilot)
        assert shown(app)[0] == ("user", "hi\nx")


async def test_escape_stops_generation(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        screen = chat_screen(app)
        engine.gate.clear()  # hold decoding after the first token batch
        screen.query_one(ChatInput).insert("a long story please")
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.streaming and screen.pane.turns.stream_view.text)
        assert screen.check_action("stop", ()) is True
        assert screen.pane.check_action("regenerate", ()) is None  # dimmed while streaming
        # "stopping…" shows at once, before the engine's next step ends the reply (the
        # action called here, so no message is handled in between; the key: below)
        bar = screen.query_one(ActivityBar)
        screen.action_stop()
        assert bar.has_class("-active") and bar.label == "stopping…"
        await pilot.press("escape")
        engine.gate.set()
        await settle(pilot)
        assert not bar.has_class("-active")
        assert not screen.streaming
        assert screen.check_action("stop", ()) is None
        assert any("stopped" in n.message for n in app._notifications)


async def test_a_stop_before_the_handle_is_back_stops_the_turn(make_app, engine, monkeypatch):
    """Esc pressed while the session call is still on its way (the handle not back yet:
    a loaded machine, right after Enter) was dropped and the reply ran to its end; the
    handle is now cancelled the moment it arrives."""
    entered, release = threading.Event(), threading.Event()
    handles = []
    submit = engine.submit

    def late_submit(request, on_event=None):
        entered.set()
        assert release.wait(30)
        handles.append(submit(request, on_event))
        return handles[-1]

    monkeypatch.setattr(engine, "submit", late_submit)
    engine.gate.clear()  # a reply holds after its first batch: it ends only by a stop
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        screen = chat_screen(app)
        screen.query_one(ChatInput).insert("a question")
        # the pane's Enter handler awaits the session call, and pilot.press() with it
        pressed = asyncio.create_task(pilot.press("enter"))
        for _ in range(3000):
            if entered.is_set():
                break
            await asyncio.sleep(0.01)
        assert entered.is_set() and not handles
        screen.action_stop()  # what Esc runs (a key would wait for the pane's handler)
        bar = screen.query_one(ActivityBar)
        assert bar.has_class("-active") and bar.label == "stopping…"
        release.set()
        await pressed
        await settle(pilot)
        assert not screen.streaming
        assert handles[0].cancelled and handles[0].done


async def test_regenerate_then_swipe_left_and_right(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "question")
        screen = chat_screen(app)
        assert screen.pane.check_action("swipe", (-1,)) is None  # only one reply
        await pilot.press("ctrl+r")
        await settle(pilot)
        reply = views(app)[-1].info
        assert (reply.index, reply.count) == (1, 2)
        assert reply.content == "Reply 2 to: question"
        user = store.active_path(screen.conversation_id)[0]
        assert len(store.replies(user.id)) == 2  # the old reply is kept
        assert screen.pane.check_action("swipe", (1,)) is None  # at the last reply

        await pilot.press("alt+left")
        await settle(pilot)
        reply = views(app)[-1].info
        assert (reply.index, reply.content) == (0, "Reply 1 to: question")
        assert store.active_path(screen.conversation_id)[-1].content == "Reply 1 to: question"
        assert screen.pane.check_action("swipe", (-1,)) is None

        await pilot.press("alt+right")
        await settle(pilot)
        assert views(app)[-1].info.index == 1


async def test_branch_bar_click_swipes(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "question")
        await pilot.press("ctrl+r")
        await settle(pilot)
        bar = views(app)[-1].query_one(".branch-bar")
        await pilot.click(bar, offset=(0, 0))  # the ◀
        await settle(pilot)
        assert views(app)[-1].info.index == 0


async def test_message_cursor_moves_visibly_and_copies_the_message_under_it(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "copy me")
        screen = chat_screen(app)
        await pilot.press("escape")  # from the input: onto the last message
        assert screen.query_one(Transcript).has_focus
        assert screen.pane.selected == 1 and views(app)[1].has_class("-selected")
        await pilot.press("c")
        assert app.clipboard == "Reply 1 to: copy me"
        await pilot.press("up")
        assert screen.pane.selected == 0
        assert views(app)[0].has_class("-selected") and not views(app)[1].has_class("-selected")
        await pilot.press("c")
        assert app.clipboard == "copy me"
        await pilot.press("down")
        assert screen.pane.selected == 1
        await pilot.press("escape")  # back to the input; the cursor goes away
        assert screen.query_one(ChatInput).has_focus and screen.pane.selected is None
        await pilot.press("alt+up")  # Alt+↑ enters the cursor too
        assert screen.query_one(Transcript).has_focus and screen.pane.selected == 1
        await pilot.press("x")  # typing goes to the input
        assert screen.query_one(ChatInput).has_focus
        assert screen.query_one(ChatInput).text == "x"


async def test_edit_sends_the_message_as_a_new_branch(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first try")
        await pilot.press("escape", "up", "e")
        assert isinstance(app.screen, EditMessageScreen)
        app.screen.query_one("#edit-area").load_text("second try")
        await pilot.press("ctrl+s")
        await settle(pilot)
        assert shown(app)[0] == ("user", "second try")
        assert shown(app)[1][1].endswith("to: second try")
        cid = chat_screen(app).conversation_id
        assert [n.content for n in store.roots(cid)] == ["first try", "second try"]


async def test_edit_cancel_changes_nothing(make_app, store, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "keep me")
        await pilot.press("escape", "e")  # on the reply: edits the user message above
        await pilot.press("escape")
        await settle(pilot)
        assert not isinstance(app.screen, EditMessageScreen)
        assert len(engine.requests) == 1
        assert shown(app)[0] == ("user", "keep me")


async def test_fork_opens_a_copy_in_a_new_conversation(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "fork me")
        first = chat_screen(app).conversation_id
        await pilot.press("escape", "f")
        await settle(pilot)
        screen = chat_screen(app)
        assert screen.conversation_id != first
        assert len(store.list_conversations()) == 2
        assert shown(app) == [("user", "fork me"), ("assistant", "Reply 1 to: fork me")]
        assert "(fork)" in store.get_conversation(screen.conversation_id).title


async def test_new_conversation_starts_empty_and_is_stored_on_first_message(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "one")
        await pilot.press("ctrl+n")
        await settle(pilot)
        assert chat_screen(app).conversation_id is None
        assert shown(app) == []
        assert len(store.list_conversations()) == 1
        await send(pilot, "two")
        assert len(store.list_conversations()) == 2
        assert len(chat_screen(app).query_one(ConversationList).rows) == 2


async def test_rename_conversation_and_cancel(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hello")
        cid = chat_screen(app).conversation_id
        await pilot.press("ctrl+t")
        assert isinstance(app.screen, PromptScreen)
        app.screen.query_one("#prompt-input").value = "Cache talk"
        await pilot.press("enter")
        await settle(pilot)
        assert store.get_conversation(cid).title == "Cache talk"
        assert "Cache talk" in chat_screen(app).sub_title
        await pilot.press("ctrl+t")
        await pilot.press("x", "escape")
        await settle(pilot)
        assert store.get_conversation(cid).title == "Cache talk"


async def test_delete_conversation_from_the_list_confirms(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "doomed")
        listing = chat_screen(app).query_one(ConversationList)
        listing.focus()
        await pilot.press("delete")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        await settle(pilot)
        assert len(store.list_conversations()) == 1
        listing.focus()
        await pilot.press("delete")
        await pilot.press("y")
        await settle(pilot)
        assert store.list_conversations() == []
        assert chat_screen(app).conversation_id is None
        assert shown(app) == []


async def test_conversation_list_opens_a_conversation(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "alpha")
        await pilot.press("ctrl+n")
        await send(pilot, "beta")
        listing = chat_screen(app).query_one(ConversationList)
        listing.focus()
        await pilot.press("down", "enter")  # newest first: beta, then alpha
        await settle(pilot)
        assert shown(app)[0] == ("user", "alpha")


async def test_toggle_panels_feeds_only_what_is_shown(make_app):
    app = make_app()
    async with app.run_test(size=WIDE) as pilot:
        await settle(pilot)
        screen = chat_screen(app)
        panels = screen.query_one(CachePanels)
        summary = screen.query_one(CacheSummary)
        assert panels.display and not summary.display
        await pilot.press("f2")
        assert not panels.display and summary.display
        await send(pilot, "hello")  # the hidden panels are not fed, the summary is
        assert panels.stats.last_turn.prompt_tokens == 0
        assert summary.stats.last_turn.prompt_tokens > 0
        assert "cached" in str(summary.content)
        await pilot.press("f2")
        assert panels.display and panels.stats.last_turn.prompt_tokens > 0


async def test_narrow_terminal_folds_the_panels_into_a_summary_line(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hello")
        screen = chat_screen(app)
        panels, summary = screen.query_one(CachePanels), screen.query_one(CacheSummary)
        listing = screen.query_one(ConversationList)
        assert not panels.display and summary.display
        chat = screen.query_one("#chat")
        assert chat.size.width >= 70  # the chat keeps most of 100 columns
        assert listing.size.width <= 22
        await pilot.press("f2")  # the panels take the list's place
        assert panels.display and not listing.display and not summary.display
        assert screen.query_one("#chat").size.width >= 50
        await pilot.resize_terminal(200, 50)
        await pilot.pause()
        assert panels.display and listing.display  # wide: the default layout again
        assert listing.size.width <= 30 and screen.query_one("#chat").size.width > 100


async def test_toggle_conversation_list(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        listing = chat_screen(app).query_one(ConversationList)
        await pilot.press("f3")
        await pilot.pause()
        assert not listing.display
        await pilot.press("f3")
        await pilot.pause()
        assert listing.display


async def test_clear_keys_confirm_then_clear_and_show_it_at_once(make_app, engine):
    app = make_app()
    async with app.run_test(size=WIDE) as pilot:
        panels = chat_screen(app).query_one(CachePanels)

        def counts():
            s = panels.stats
            return {"hot": s.hot.entries, "ssd": s.ssd.entries, "tails": s.tails.entries}

        await send(pilot, "fill the cache with something long enough to make tails")
        assert all(counts().values())
        for key, tier in [("f7", "tails"), ("f6", "ssd"), ("f5", "hot"), ("f8", "all")]:
            if tier == "all":
                await send(pilot, "fill it again")
            before = counts()
            assert before[tier if tier != "all" else "hot"]
            await pilot.press(key)
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("n")
            await settle(pilot)
            assert engine.cleared[-1:] != [tier] and counts() == before
            await pilot.press(key)
            await pilot.press("y")
            await settle(pilot)
            assert engine.cleared[-1] == tier
            after = counts()  # the panels show it at once, not at the next poll
            for name in ("hot", "ssd", "tails"):
                expected = 0 if tier in (name, "all") else before[name]
                assert after[name] == expected, (tier, name, after)
            assert any(n.title == "Cache cleared" for n in app._notifications)
        assert engine.cleared == ["tails", "ssd", "hot", "all"]


async def test_model_picker_loads_with_progress(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("f4")
        assert isinstance(app.screen, ModelPickerScreen)
        options = app.screen.query_one("#model-options")
        specs = [options.get_option_at_index(i).id for i in range(options.option_count)]
        assert specs[:2] == ["demo", "demo-gemma"] and "tiny:llama" not in specs
        app.screen.query_one("#model-path").focus()
        await pilot.press(*"tiny:llama", "enter")
        await settle(pilot)
        assert engine.model_name == "tiny:llama"
        assert "tiny:llama" in chat_screen(app).sub_title
        assert any(n.title == "Model loaded" for n in app._notifications)


async def test_model_picker_cancel_and_typed_path(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("f4")
        await pilot.press("escape")
        await settle(pilot)
        assert engine.model_name == "demo"
        await pilot.press("f4")
        app.screen.query_one("#model-path").focus()
        await pilot.press(*"/models/x", "enter")
        await settle(pilot)
        assert engine.model_name == "demo"  # no such directory: said, nothing loaded
        assert any("/models/x: no such directory" in n.message for n in app._notifications)
        await pilot.press("f4")
        app.screen.query_one("#model-path").focus()
        await pilot.press(*"mlx-community/some-model", "enter")  # a repo id goes through
        await settle(pilot)
        assert engine.model_name == "mlx-community/some-model"


async def test_quit_key_exits(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+q")
        await pilot.pause()
    assert app.return_code == 0
