"""tui/widgets/tool_block.py: a call's one-line summary, a result's title and folding, and
the marks of an error, a denial and a running call that finished."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Collapsible
from tierchat.tui.widgets.tool_block import (
    RESULT_LINES_SHOWN,
    ToolCallBlock,
    ToolResultBlock,
    call_summary,
    folded,
    result_title,
)

pytestmark = pytest.mark.anyio


def test_call_summary():
    assert call_summary("files", "read", '{"path": "a"}') == '⚙ files · read {"path": "a"}'
    assert call_summary("", "read", {"path": "a"}) == '⚙ read {"path": "a"}'
    assert call_summary("s", "t", "not\n json") == "⚙ s · t not json"
    long = call_summary("s", "t", {"x": "y" * 500})
    assert long.endswith("…") and len(long) < 200


def test_result_title_and_folding():
    assert result_title("ok", "hello") == "✓ result · 5 chars"
    assert result_title("error", "a\nb") == "✗ error result · 2 lines"
    text = "\n".join(str(i) for i in range(100))
    short = folded(text)
    assert short.split("\n")[:RESULT_LINES_SHOWN] == [str(i) for i in range(RESULT_LINES_SHOWN)]
    assert f"{100 - RESULT_LINES_SHOWN} more lines" in short
    assert folded("a\nb") == "a\nb"


class Host(App):
    def compose(self) -> ComposeResult:
        yield ToolCallBlock("files", "read_file", {"path": "/tmp/x"})
        yield ToolResultBlock("short", "ok", id="short")
        yield ToolResultBlock("\n".join("line" for _ in range(40)), "ok", id="long")
        yield ToolResultBlock("no such file", "error", id="error")


async def test_blocks_show_and_update():
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert not app.query_one("#short Collapsible", Collapsible).collapsed
        assert app.query_one("#long Collapsible", Collapsible).collapsed
        error = app.query_one("#error", ToolResultBlock)
        assert error.has_class("-error")
        assert not app.query_one("#error Collapsible", Collapsible).collapsed
        error.show("stopped by the user", "cancelled")
        await pilot.pause()
        assert error.has_class("-stopped") and not error.has_class("-error")
        assert "cancelled" in app.query_one("#error Collapsible", Collapsible).title
