"""Issue 21 (part A), as a daily user meets the console: the transcript shows what was
typed, keys people expect (Ctrl+C stops a reply, Alt+Enter is a newline, the edit
cursor at the end), an export cut inside a code block, panels that agree with events."""

from __future__ import annotations

import pytest
from tierchat.tui.widgets.transcript import Transcript
from tui_kit import SIZE, chat_screen, send, settle

pytestmark = pytest.mark.anyio


def views(app):
    return chat_screen(app).query_one(Transcript).views


def rows_of(app, widget) -> list[str]:
    """The screen rows ``widget`` covers, as text (what the user sees there)."""
    strips = app.screen._compositor.render_strips()
    region = widget.region
    return [
        strips[y].text[region.x : region.right].rstrip() for y in range(region.y, region.bottom)
    ]


async def test_user_messages_show_literally_markup_and_line_breaks_included(make_app):
    typed = "In HTML, what does <br> do? compute 2*3*4\nroses are _red_\n\n  # violets"
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, typed)
        user, reply = views(app)
        # every line of the message is a row of its own (a poem keeps its breaks)
        assert rows_of(app, user.query_one(".message-body")) == typed.splitlines()
        # a reply is still Markdown
        assert reply.query_one(".message-body") is reply.markdown


def _blocks(markdown: str) -> list[tuple[str, str]]:
    """``(block type, text)`` of the top-level blocks a CommonMark reader sees."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(markdown)
    out = []
    for i, tok in enumerate(tokens):
        if tok.level != 0 or tok.type.endswith("_close"):
            continue
        if tok.type == "fence":
            out.append(("fence", tok.content))
        elif tok.type == "heading_open":
            out.append(("heading", tokens[i + 1].content))
    return out


@pytest.mark.parametrize("scope", ["path", "tree"])
def test_markdown_export_closes_the_fence_of_a_reply_cut_in_a_code_block(store, scope):
    from tierchat.tui.export import close_fences, export_conversation

    cid = store.create_conversation("cut")
    q = store.add_node(cid, None, "user", "write a loop")
    cut = "Here:\n\n````python\nfor i in range(3):\n    print('```')\n"  # stopped here
    a = store.add_node(cid, q.id, "assistant", cut, meta={"finish_reason": "cancelled"})
    store.add_node(cid, a.id, "user", "thanks")
    md = export_conversation(store, cid, "md", scope)
    if scope == "path":
        assert _blocks(md) == [
            ("heading", "cut"),
            ("heading", "You"),
            ("heading", "Assistant"),
            ("fence", "for i in range(3):\n    print('```')\n"),
            ("heading", "You"),  # after the cut reply: text again, not code
        ]
    else:
        from markdown_it import MarkdownIt

        tokens = MarkdownIt("commonmark").parse(md)
        fences = [t.content for t in tokens if t.type == "fence"]
        assert fences == ["for i in range(3):\n    print('```')\n"]  # closed in its item
        assert any(t.type == "inline" and "thanks" in t.content for t in tokens)
    # text that closes its blocks is left as it is
    closed = "a\n~~~\ncode\n~~~~\nafter\n```\n``` not a close\n```"
    assert close_fences(closed) == closed
    assert close_fences("~~~\n```\n") == "~~~\n```\n~~~"


@pytest.mark.parametrize("scope", ["path", "tree"])
def test_markdown_export_renders_user_text_as_typed(store, scope):
    """User text is escaped (``<br>``, ``*3*``, a leading ``#``, ``1.``, links, entities);
    its line breaks stay line breaks; replies stay the model's Markdown."""
    from markdown_it import MarkdownIt
    from tierchat.tui.export import export_conversation

    typed = "In HTML, what does <br> do?\ncompute *3* _x_ `y` [a](b) &amp; a\\b\n# no\n1. no\n- no"
    cid = store.create_conversation("literal")
    q = store.add_node(cid, None, "user", typed)
    store.add_node(cid, q.id, "assistant", "**bold** reply")
    md = export_conversation(store, cid, "md", scope)
    html = MarkdownIt("commonmark").render(md)
    shown = (
        html.replace("<br />\n", "\n").replace("&lt;", "<").replace("&gt;", ">")
        .replace("&amp;", "&")
    )  # fmt: skip
    assert typed in shown, html
    assert "<strong>bold</strong>" in html
    assert "<h1>no" not in html and "<ol>" not in html and "<em>" not in html


async def _start_held_reply(pilot, engine, text: str):
    """Send ``text`` with decoding held after the first token batch; the screen streams."""
    from tierchat.tui.widgets.chat_input import ChatInput

    await settle(pilot)
    engine.gate.clear()
    screen = chat_screen(pilot.app)
    screen.query_one(ChatInput).insert(text)
    await pilot.press("enter")
    for _ in range(500):
        await pilot.pause()
        if (
            screen.streaming
            and screen.pane.turns.stream_view
            and screen.pane.turns.stream_view.text
        ):
            return screen
    raise AssertionError("the reply did not start")


async def test_ctrl_c_stops_a_reply_and_the_app_stays(make_app, engine, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await _start_held_reply(pilot, engine, "a long answer please")
        await pilot.press("ctrl+c")
        engine.gate.set()
        await settle(pilot)
        assert app.is_running and not screen.streaming
        (reply,) = [n for n in store.active_path(screen.conversation_id) if n.role == "assistant"]
        assert reply.meta["finish_reason"] == "cancelled"  # stopped, the part kept
        assert not [n for n in app._notifications if "quit" in n.message.lower()]
        # idle, Ctrl+C is Textual's quit hint as before (and the app still runs)
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert [n for n in app._notifications if "quit" in n.message.lower()]
        assert app.is_running


async def test_alt_enter_and_ctrl_j_insert_newlines_and_the_keys_are_named(make_app, store):
    from tierchat.tui.widgets.chat_input import ChatInput

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        box = chat_screen(app).query_one(ChatInput)
        await pilot.press("a", "alt+enter", "b", "ctrl+j", "c", "enter")
        await settle(pilot)
        assert [n.content for n in store.active_path(chat_screen(app).conversation_id)][0] == (
            "a\nb\nc"
        )
        assert "Alt+Enter" in str(box.placeholder) and "Ctrl+J" in str(box.placeholder)
        rows = {row[3]: row for row in app.binding_rows()}
        assert rows["newline"][1].split(" / ") == ["^j", "alt+⏎", "shift+⏎"]
        assert "Shift+Enter: only terminals with the kitty" in rows["newline"][2]


async def test_the_edit_dialog_opens_with_the_cursor_at_the_end(make_app):
    from textual.widgets import TextArea

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first line\nsecond line")
        await pilot.press("escape", "up", "e")
        await pilot.pause()
        area = app.screen.query_one("#edit-area", TextArea)
        assert area.cursor_location == (1, len("second line"))


@pytest.mark.parametrize(
    ("data", "keys"),
    [
        ("\x1b\x1b[C", ["alt+right"]),  # ESC prefix before an arrow (macOS Terminal, iTerm2)
        ("\x1b\x1b[D\x1b\x1b[A\x1b\x1b[B", ["alt+left", "alt+up", "alt+down"]),
        ("\x1b\x1bOC", ["alt+right"]),  # the arrow in application cursor mode
        ("\x1b[1;3C", ["alt+right"]),  # xterm's modifier form, as before
        ("\x1b\r", ["alt+enter"]),
        ("\x1bx", ["alt+x"]),
        ("a\x1b\x1b[Cb", ["a", "alt+right", "b"]),
        ("\x1b\x1b\x1b[C", ["escape", "alt+right"]),
    ],
)
def test_esc_prefixed_keys_are_read_as_alt_keys(data, keys):
    from tierchat.tui.terminal import AltPrefixParser

    parser = AltPrefixParser()
    tokens = list(parser.feed(data)) + list(parser.feed(""))  # end of input: no delay
    assert [t.key for t in tokens] == keys


def test_an_escape_alone_stays_escape_and_is_never_joined_to_a_later_key():
    import time

    from textual import constants
    from tierchat.tui.terminal import AltPrefixParser

    parser = AltPrefixParser()
    out = list(parser.feed("\x1b"))
    time.sleep(constants.ESCAPE_DELAY * 2)
    out += list(parser.tick())  # the delay ran out: the Esc key
    out += list(parser.feed("\x1b[C"))
    time.sleep(constants.ESCAPE_DELAY * 2)
    out += list(parser.tick())
    assert [t.key for t in out] == ["escape", "right"]
    # two Esc presses within the delay stay two Escapes
    parser = AltPrefixParser()
    out = list(parser.feed("\x1b\x1b"))
    time.sleep(constants.ESCAPE_DELAY * 2)
    out += list(parser.tick())
    assert [t.key for t in out] == ["escape", "escape"]


def test_the_app_reads_keys_with_the_alt_prefix_parser():
    from textual.driver import Driver
    from textual.drivers.linux_driver import LinuxDriver
    from tierchat.tui.terminal import TierchatDriver, driver_class

    # Textual's LinuxDriver still builds its parser by name, so ours takes its place
    assert driver_class(LinuxDriver) is TierchatDriver
    assert driver_class(Driver) is Driver  # any other driver is left as it is


async def test_panels_say_loading_while_a_model_loads_not_caching_off(make_app, engine):
    from dataclasses import replace

    from tierchat.core.api import CacheStats
    from tierchat.tui.widgets.cache_panels import CachePanels, CacheSummary

    app = make_app()
    async with app.run_test(size=(150, 40)) as pilot:
        await settle(pilot)
        screen = chat_screen(app)
        # what the engine reports while it loads: no cache, no model yet
        loading_stats = CacheStats(model="", enabled=False, supported=None)
        engine.stats = lambda: replace(loading_stats, memory=CacheStats().memory)
        screen.loading_model = "demo-gemma"
        screen.app.poll_stats()
        await pilot.pause()
        panels = screen.query_one(CachePanels)
        header = str(panels.query_one("#cache-model").render())
        hot_na = str(panels.query_one("#hot-panel .na").render())
        assert header.startswith("loading demo-gemma…") and "disabled" not in header
        assert hot_na == "N/A — loading demo-gemma…"
        screen.panels_visible = False
        screen.app.poll_stats()
        await pilot.pause()
        assert str(screen.query_one(CacheSummary).render()) == "cache (F2): loading demo-gemma…"
        # loaded: the readings come back
        screen.loading_model = ""
        screen.panels_visible = True
        del engine.stats
        screen.app.poll_stats()
        await pilot.pause()
        assert str(panels.query_one("#cache-model").render()).startswith("demo · cache on")
        assert not panels.query_one("#hot-panel").has_class("-off")


def test_the_memory_ceiling_says_what_bounds_it():
    from tierchat.core.api import MemoryStats
    from tierchat.tui.widgets.cache_panels import ceiling_source

    gib = 1 << 30
    # min(limit 20 GiB, in use 2 + free 17 = 19 GiB): free RAM bounds it, and moves with it
    by_ram = MemoryStats(active=gib, cache=gib, limit=19 * gib, system_total=32 * gib,
                         system_available=17 * gib)  # fmt: skip
    assert ceiling_source(by_ram) == "free RAM"
    by_limit = MemoryStats(active=gib, cache=gib, limit=8 * gib, system_total=32 * gib,
                           system_available=17 * gib)  # fmt: skip
    assert ceiling_source(by_limit) == "limit"
    unknown_system = MemoryStats(active=gib, limit=8 * gib)  # no /proc/meminfo: the limit
    assert ceiling_source(unknown_system) == "limit"


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_the_help_fits_with_its_last_line_and_the_footer(make_app, size):
    """At 120×40 the help's last line and the footer were cut off; the table scrolls."""
    from textual.widgets import DataTable, Footer, Static

    app = make_app()
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        await pilot.press("f1")
        await settle(pilot)
        hint = app.screen.query_one(".hint", Static)
        dialog = app.screen.query_one("#dialog")
        assert hint.region.height >= 1 and hint.region.bottom <= dialog.region.bottom - 1
        assert dialog.region.bottom <= size[1] - 1  # the footer's row stays free
        footer = app.screen_stack[0].query_one(Footer)
        assert footer.region.y == size[1] - 1
        table = app.screen.query_one(DataTable)
        assert table.row_count > table.region.height  # every binding, by scrolling


async def test_a_long_paste_is_folded_in_the_transcript_and_sent_whole(make_app, engine):
    from tierchat.tui.widgets.transcript import FOLD_SHOWN

    pasted = "\n".join(f"line {i}" for i in range(300))
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, pasted)
        await settle(pilot)
        user = [v for v in app.screen.query_one(Transcript).views if v.info.role == "user"][0]
        rows = rows_of(app, user.query_one(".message-body"))
        assert rows[:FOLD_SHOWN] == [f"line {i}" for i in range(FOLD_SHOWN)]
        assert rows[FOLD_SHOWN] == f"… {300 - FOLD_SHOWN} more lines (v shows the whole message)"
        assert len(rows) == FOLD_SHOWN + 1
        assert user.text == pasted  # copy and raw view take the whole message
        assert engine.tokenizer.decode(engine.requests[-1].prompt_ids).count("line ") == 300


async def test_messages_show_when_they_were_written(make_app):
    from tierchat.tui.widgets.conversation_list import fmt_when
    from tui_kit import fixed_clock

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "what time is it?")
        await settle(pilot)
        user, reply = views(app)
        when = fmt_when(fixed_clock())
        assert str(user.query_one(".role").render()) == f"you · {when}"
        assert str(reply.query_one(".role").render()) == f"assistant · demo · {when}"
