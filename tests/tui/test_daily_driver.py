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
