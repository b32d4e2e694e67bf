"""Blocks of a tool round in the transcript (docs/DESIGN.md §12.1, §16): a call (server,
tool, arguments) under the reply that made it, and a result (folded like a long paste,
collapsible, errors and cancelled calls marked).
"""

from __future__ import annotations

import json
from typing import Any, Literal

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


def result_state(meta: dict[str, Any] | None) -> ResultState:
    """A stored tool result's state from its node's ``meta`` (core/chat/tool_rounds.py):
    cancelled, denied, error (``is_error``: the tool said so, or the call failed) or ok."""
    meta = meta or {}
    if meta.get("cancelled"):
        return "cancelled"
    if meta.get("denied"):
        return "denied"
    return "error" if meta.get("is_error") else "ok"


def result_name(meta: dict[str, Any] | None) -> str:
    """``server.tool`` of a stored result, or the function the model named."""
    meta = meta or {}
    if meta.get("server") and meta.get("tool"):
        return f"{meta['server']}.{meta['tool']}"
    return str(meta.get("name") or "tool")


CallRow = tuple[str, str, str]
"""One call of an assistant step as its block shows it: ``(server, tool, arguments)``."""


def call_rows(meta: dict[str, Any] | None, servers: dict[str, CallRow]) -> tuple[CallRow, ...]:
    """The calls of an assistant step (``meta["tool_calls"]``, OpenAI form) as
    ``(server, tool, arguments)``; ``servers`` maps a call id to the row its stored
    result names (server and tool), else the server is "" and the tool the function."""
    rows = []
    for call in (meta or {}).get("tool_calls") or ():
        fn = call.get("function") or {}
        args = fn.get("arguments")
        args = args if isinstance(args, str) else json.dumps(args or {})
        known = servers.get(str(call.get("id", "")))
        rows.append((known[0], known[1], args) if known else ("", str(fn.get("name", "")), args))
    return tuple(rows)
