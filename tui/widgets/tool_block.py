"""Blocks of a tool round in the transcript (docs/DESIGN.md §12.1): a call (server, tool, arguments)
under the reply that made it, and a result (folded like a long paste, collapsible, errors
and cancelled calls marked).
"""

from __future__ import annotations

import json
from typing import Literal

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Static

ResultState = Literal["ok", "error", "cancelled", "denied", "running", "waiting"]

CALL_ARGUMENTS_SHOWN = 160
"""Characters of a call's arguments on its one-line summary."""
RESULT_LINES_SHOWN = 8
"""Lines of a result shown before the rest is folded (``v`` shows the whole message)."""

_MARK = {
    "ok": "✓",
    "error": "✗ error",
    "cancelled": "⊘ cancelled",
    "denied": "⊘ denied",
    "running": "… running",
    "waiting": "? waiting for approval",
}


def call_summary(server: str, tool: str, arguments: object) -> str:
    """``server · tool {"a": 1}`` on one line, arguments compacted and cut at
    :data:`CALL_ARGUMENTS_SHOWN` characters."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            text = " ".join(arguments.split())
        else:
            text = json.dumps(arguments, ensure_ascii=False)
    else:
        text = json.dumps(arguments, ensure_ascii=False)
    if len(text) > CALL_ARGUMENTS_SHOWN:
        text = text[: CALL_ARGUMENTS_SHOWN - 1] + "…"
    where = f"{server} · " if server else ""
    return f"⚙ {where}{tool} {text}"


def result_title(state: ResultState, text: str) -> str:
    """The result block's title: its state and size (``✓ result · 12 lines``)."""
    lines = text.count("\n") + 1 if text else 0
    size = f"{lines:,} line{'s' if lines != 1 else ''}" if lines > 1 else f"{len(text):,} chars"
    return f"{_MARK[state]} result · {size}"


def folded(text: str, shown: int = RESULT_LINES_SHOWN) -> str:
    """``text``, or its first ``shown`` lines and how many more there are."""
    lines = text.split("\n")
    if len(lines) <= shown * 2:
        return text
    return "\n".join(lines[:shown]) + f"\n… {len(lines) - shown:,} more lines (v shows all)"


class ToolCallBlock(Static):
    """One call a reply made: ``⚙ server · tool {arguments}``."""

    DEFAULT_CSS = """
    ToolCallBlock { height: auto; color: $warning; padding: 0 0 0 1; }
    """

    def __init__(self, server: str, tool: str, arguments: object, **kwargs) -> None:
        super().__init__(call_summary(server, tool, arguments), markup=False, **kwargs)
        self.server, self.tool, self.arguments = server, tool, arguments


class ToolResultBlock(Vertical):
    """A call's result, collapsed to its title unless it is short; an error, a denial or a
    cancelled call is marked in the title and by the ``-error`` / ``-stopped`` classes."""

    DEFAULT_CSS = """
    ToolResultBlock { height: auto; }
    ToolResultBlock > Collapsible {
        background: transparent; border: none; padding: 0; margin: 0;
    }
    ToolResultBlock > Collapsible > Contents { padding: 0 0 0 2; height: auto; }
    ToolResultBlock.-error > Collapsible > CollapsibleTitle { color: $error; }
    ToolResultBlock.-stopped > Collapsible > CollapsibleTitle { color: $warning; }
    ToolResultBlock .tool-result { color: $text-muted; }
    """

    def __init__(self, text: str, state: ResultState = "ok", **kwargs) -> None:
        super().__init__(**kwargs)
        self.text, self.state = text, state
        self.set_class(state == "error", "-error")
        self.set_class(state in ("cancelled", "denied"), "-stopped")

    def compose(self) -> ComposeResult:
        short = self.text.count("\n") < 3 and len(self.text) <= 240
        yield Collapsible(
            Static(folded(self.text), classes="tool-result", markup=False),
            title=result_title(self.state, self.text),
            collapsed=not (short or self.state == "error"),
        )

    def show(self, text: str, state: ResultState) -> None:
        """Replace the result (a running call that finished, was cancelled or failed)."""
        self.text, self.state = text, state
        self.set_class(state == "error", "-error")
        self.set_class(state in ("cancelled", "denied"), "-stopped")
        box = self.query_one(Collapsible)
        box.title = result_title(state, text)
        box.query_one(".tool-result", Static).update(folded(text))
