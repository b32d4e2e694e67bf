"""Issue 21 (part A), as a daily user meets the console: the transcript shows what was
typed, keys people expect (Ctrl+C stops a reply, Alt+Enter is a newline, the edit
cursor at the end), an export cut inside a code block, panels that agree with events."""

from __future__ import annotations

import pytest
from tierchat.tui.widgets.transcript import Transcript
from tui_kit import SIZE, chat_screen, send

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
