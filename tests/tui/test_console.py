"""Issue 13, as a person meets the console: branches everywhere, per-conversation
settings, reasoning blocks, export, errors in words, panels that agree, a long chat."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tierchat.core.chat.session import ConversationSettings
from tierchat.core.live_status import clear_report
from tierchat.core.sampling_params import SamplingParams
from tierchat.tui.screens.conversation_settings import ConversationSettingsScreen
from tierchat.tui.widgets.cache_panels import CachePanels, CacheSummary, cache_summary
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.transcript import Transcript
from tui_kit import SIZE, WIDE, FlakyEngine, chat_screen, send, settle, wait_for

pytestmark = pytest.mark.anyio


def views(app):
    return chat_screen(app).query_one(Transcript).views


def notes(app) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]


async def test_edited_user_messages_show_branches_and_every_branch_is_reachable(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "original")
        await pilot.press("ctrl+r")  # two replies under the original
        await settle(pilot)
        await pilot.press("escape", "up", "e")
        app.screen.query_one("#edit-area").load_text("edited")
        await pilot.press("ctrl+s")
        await settle(pilot)
        user = views(app)[0]
        assert (user.info.content, user.info.index, user.info.count) == ("edited", 1, 2)
        bar = str(user.query_one(".branch-bar").content)
        assert "◀" in bar and "2/2" in bar and "▶" in bar
        await pilot.press("escape", "home", "left")  # to the original user message
        await settle(pilot)
        shown = [(v.info.role, v.info.content, v.info.index, v.info.count) for v in views(app)]
        assert shown[0] == ("user", "original", 0, 2)
        assert shown[1][1] == "Reply 2 to: original" and shown[1][2:] == (1, 2)  # its swipes
        await pilot.press("down", "left")  # and its first reply
        await settle(pilot)
        assert views(app)[1].info.content == "Reply 1 to: original"
        await send(pilot, "continue the old branch")  # any branch can be continued
        cid = chat_screen(app).conversation_id
        path = [n.content for n in store.active_path(cid)]
        assert path[:2] == ["original", "Reply 1 to: original"]
        assert path[2] == "continue the old branch"


async def test_fork_at_a_user_message_generates_with_ctrl_r_and_focuses_the_input(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "fork here")
        await pilot.press("escape", "up", "f")
        await settle(pilot)
        screen = chat_screen(app)
        assert [v.info.role for v in views(app)] == ["user"]
        assert screen.query_one(ChatInput).has_focus  # typing goes somewhere at once
        assert screen.pane.check_action("regenerate", ()) is True
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert [v.info.role for v in views(app)] == ["user", "assistant"]
        assert len(store.list_conversations()) == 2


async def test_settings_are_per_conversation_and_used_by_the_next_turn(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first")
        await pilot.press("f9")
        dialog = app.screen
        assert isinstance(dialog, ConversationSettingsScreen)
        dialog.query_one("#system").load_text("Answer like a pirate.")
        await pilot.pause()
        note = str(dialog.query_one("#reuse-note").content)
        assert "New prefix" in note and "prefills about" in note
        dialog.query_one("#temperature").value = "0.8"
        dialog.query_one("#seed").value = "5"
        await pilot.press("ctrl+s")
        await settle(pilot)
        cid = chat_screen(app).conversation_id
        assert store.conversation_settings(cid)["temperature"] == 0.8
        assert views(app)[0].info.role == "system"  # the system prompt shows
        await pilot.press("ctrl+r")
        await settle(pilot)
        await pilot.press("ctrl+r")
        await settle(pilot)
        seeds = [r.sampling.seed for r in engine.requests[-2:]]
        assert seeds == [6, 7] and engine.requests[-1].sampling.temperature == 0.8
        prompt = engine.tokenizer.decode(engine.requests[-1].prompt_ids)
        assert "<|system|>Answer like a pirate." in prompt
        await pilot.press("ctrl+n")
        await send(pilot, "another chat")
        assert engine.requests[-1].sampling.temperature == 0.0  # the default for a new conversation


async def test_settings_dialog_sets_presence_and_frequency_penalties(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first")
        await pilot.press("f9")
        dialog = app.screen
        assert isinstance(dialog, ConversationSettingsScreen)
        for wid, keys in (("#presence_penalty", "0.5"), ("#frequency_penalty", "-0.25")):
            dialog.query_one(wid).focus()
            await pilot.press("end", "ctrl+u", *keys)  # cleared and typed as a user would
            assert dialog.query_one(wid).value == keys
        await pilot.press("ctrl+s")
        await settle(pilot)
        cid = chat_screen(app).conversation_id
        saved = store.conversation_settings(cid)
        assert (saved["presence_penalty"], saved["frequency_penalty"]) == (0.5, -0.25)
        await pilot.press("ctrl+r")
        await settle(pilot)
        request = engine.requests[-1]
        assert (request.sampling.presence_penalty, request.sampling.frequency_penalty) == (
            0.5,
            -0.25,
        )
        await pilot.press("f9")  # shown again as saved
        dialog = app.screen
        assert dialog.query_one("#presence_penalty").value == "0.5"
        assert dialog.query_one("#frequency_penalty").value == "-0.25"
        dialog.query_one("#frequency_penalty").value = "2.5"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "frequency_penalty must be in -2..2" in str(dialog.query_one("#error").content)
        await pilot.press("escape")


async def test_settings_dialog_refuses_bad_values(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("f9")
        app.screen.query_one("#top_p").value = "0"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, ConversationSettingsScreen)
        assert "top_p must be in (0, 1]" in str(app.screen.query_one("#error").content)
        await pilot.press("escape")


async def test_regenerate_at_temperature_zero_says_so(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert any("Temperature is 0" in n for n in notes(app))


async def test_reasoning_is_collapsed_and_toggles(make_app, store):
    engine = FlakyEngine("demo", reasoning="First I think about caches.")
    app = make_app(engine=engine)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, "think first")
            reply = views(app)[-1]
            box = reply.query_one("Collapsible")
            assert box.collapsed and "reasoning · 5 words" in box.title
            assert "First I think" not in reply.markdown.source
            assert reply.markdown.source.startswith("Reply 1 to: think")  # 64-token cap
            await pilot.press("escape", "t")
            assert not box.collapsed
            path = store.active_path(chat_screen(app).conversation_id)
            assert path[-1].content.startswith("<think>")  # stored whole; the template decides
    finally:
        engine.close()


async def test_export_path_and_tree(make_app, settings):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "export me")
        await pilot.press("ctrl+r")
        await settle(pilot)
        screen = chat_screen(app)
        await screen.pane.action_export("md", "path")
        await screen.pane.action_export("json", "tree")
        folder = settings.data_dir / "exports"
        md = next(folder.glob("*-path.md")).read_text()
        assert "## You" in md and "export me" in md and "Reply 2 to: export me" in md
        assert "Reply 1 to" not in md  # the active path only
        tree = json.loads(next(folder.glob("*-tree.json")).read_text())
        replies = tree["roots"][0]["children"]
        assert [r["content"] for r in replies] == ["Reply 1 to: export me", "Reply 2 to: export me"]
        assert [r["active"] for r in replies] == [False, True]


async def test_cancel_during_prefill_is_said_in_words(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        engine.prefill_gate.clear()  # hold the prefill
        screen = chat_screen(app)
        screen.query_one(ChatInput).insert("never mind")
        await pilot.press("enter")
        # the prefill is held at the gate and the screen knows it streams: by events,
        # not by a count of pauses (which a loaded machine outran)
        await wait_for(pilot, lambda: engine.prefill_held.is_set() and screen.streaming, 60)
        await pilot.press("escape")
        engine.prefill_gate.set()
        await settle(pilot, timeout=60)
        assert any(n.startswith("Stopped: ") for n in notes(app))
        assert not any(n.severity == "error" for n in app._notifications)
        assert screen.query_one(ChatInput).text == "never mind"  # given back


async def test_sending_without_a_model_says_so(make_app):
    class NoModel(FlakyEngine):
        @property
        def tokenizer(self):
            return None

    engine = NoModel("")
    engine.model_name = ""
    app = make_app(engine=engine)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            engine.model_name = ""  # the load finished in the fake; pretend it did not
            chat_screen(app).query_one(ChatInput).insert("hello")
            await pilot.press("enter")
            await settle(pilot)
            text = " ".join(notes(app))
            assert "no model is loaded" in text and "NoneType" not in text
            assert app.store.list_conversations() == []  # no empty conversation made
            assert chat_screen(app).query_one(ChatInput).text == "hello"
    finally:
        engine.close()


async def test_switching_models_warns_about_the_other_models_replies(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hello")
        chat_screen(app).action_load_model("demo-gemma")
        await settle(pilot)
        assert any("replies of demo" in n for n in notes(app))


async def test_clear_report_names_every_tier_that_changed(make_app, engine):
    app = make_app()
    async with app.run_test(size=WIDE) as pilot:
        await send(pilot, "fill the cache with something long enough for blocks and tails")
        before = engine.stats()
        engine.clear("tails")
        engine._ssd.clear()  # as if clearing tails also dropped checkpoint files on disk
        report = clear_report("tails", before, engine.stats())
        assert report.startswith("Cleared tails: ") and "SSD −" in report and "tails −" in report


async def test_a_stats_poll_while_the_panels_are_taken_down_is_ignored(make_app, engine):
    # the app's stats poll can tick while the app closes and the panels' children are
    # already gone: the snapshot is not shown, nothing raises
    app = make_app()
    async with app.run_test(size=WIDE) as pilot:
        await settle(pilot)
        panels = chat_screen(app).query_one(CachePanels)
        await panels.remove_children()
        shown = panels.stats
        assert shown is not None
        panels.stats = dataclasses.replace(shown, block_size=shown.block_size + 1)
        await pilot.pause()


def test_summary_line_and_rates_for_tiny_prefills():
    from tierchat.core.api import CacheStats, TurnMetrics
    from tierchat.tui.format import fmt_rate

    assert cache_summary(None).startswith("cache (F2): waiting")
    stats = CacheStats(last_turn=TurnMetrics(prompt_tokens=100, cached_tokens=99, prefill_tokens=1))
    assert "last turn 99/100 cached" in cache_summary(stats)
    assert fmt_rate(1.2, 1) == "— (1 token)" and fmt_rate(412.34, 400) == "412.3 tok/s"


async def test_a_long_conversation_mounts_a_window_and_shows_earlier_on_demand(make_app, store):
    cid = store.create_conversation("long")
    parent = None
    for i in range(30):
        user = store.add_node(cid, parent, "user", f"question {i}")
        parent = store.add_node(cid, user.id, "assistant", f"answer {i}").id
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        transcript = chat_screen(app).query_one(Transcript)
        assert len(transcript.views) == Transcript.WINDOW and transcript.hidden == 20
        assert views(app)[0].info.content == "question 10"
        await pilot.press("escape", "home", "up")  # past the top: older ones come in
        await settle(pilot)
        await pilot.pause()
        assert transcript.hidden == 0 and len(transcript.views) == 60
        screen = chat_screen(app)
        assert views(app)[screen.pane.selected].info.content == "answer 9"
        await send(pilot, "one more")  # the window slides: newest kept, count bounded
        assert views(app)[-1].info.content == "Reply 1 to: one more"


async def test_narrow_summary_shows_the_last_turn(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hello")
        summary = chat_screen(app).query_one(CacheSummary)
        assert "cached" in str(summary.content) and "(F2)" in str(summary.content)


def test_conversation_settings_from_saved_values():
    defaults = ConversationSettings(sampling=SamplingParams(temperature=0.0, max_tokens=64))
    s = ConversationSettings.from_dict({"temperature": 0.5, "junk": 1}, defaults)
    assert (s.sampling.temperature, s.sampling.max_tokens) == (0.5, 64)
    assert ConversationSettings.from_dict({"temperature": "hot"}, defaults) == defaults
