"""The approval asked before a tool call runs (docs/DESIGN.md §12.1, §16): allow once,
allow this tool for the rest of the conversation, or deny with a reason that is sent to the
model as the call's result. Esc denies with no reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar, Literal

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static

Decision = Literal["once", "always", "deny"]

ARGUMENTS_SHOWN = 2000
"""Characters of the call's arguments the dialog shows; the rest is cut with a count."""


@dataclass(frozen=True)
class Approval:
    """What the user chose for one call. ``reason`` is set only for ``deny``."""

    decision: Decision
    reason: str = ""

    @property
    def allowed(self) -> bool:
        return self.decision != "deny"


def arguments_text(arguments: object, limit: int = ARGUMENTS_SHOWN) -> str:
    """A call's arguments as indented JSON (or the raw text when they are not JSON), cut
    at ``limit`` characters with the number of characters left out."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            text = arguments
        else:
            text = json.dumps(arguments, indent=2, ensure_ascii=False)
    else:
        text = json.dumps(arguments, indent=2, ensure_ascii=False)
    if len(text) > limit:
        text = f"{text[:limit]}\n… {len(text) - limit:,} more characters"
    return text


class ToolApprovalScreen(ModalScreen[Approval]):
    """Shows ``server``, ``tool`` and the arguments; dismisses with an :class:`Approval`.

    Keys: ``y`` allow once, ``a`` allow this tool for the conversation, ``n`` deny (the
    reason field gets the focus; Enter sends it), Esc deny with no reason.
    """

    CSS_PATH = "tool_approval.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "decide('once')", "Allow once", id="tool_allow_once"),
        Binding("a", "decide('always')", "Allow for this chat", id="tool_allow_always"),
        Binding("n", "deny", "Deny", id="tool_deny"),
        Binding("escape", "decide('deny')", "Deny", id="tool_deny_now"),
    ]

    def __init__(self, server: str, tool: str, arguments: object, *, round_no: int = 1) -> None:
        super().__init__()
        self.server = server
        self.tool = tool
        self.arguments = arguments
        self.round_no = round_no

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog") as dialog:
            dialog.border_title = f"Run {self.tool}? (round {self.round_no})"
            yield Static(f"server {self.server} · tool {self.tool}", id="what", markup=False)
            with VerticalScroll(id="arguments"):
                yield Static(arguments_text(self.arguments), markup=False)
            yield Input(placeholder="reason for the model (optional), Enter to deny", id="reason")
            with Horizontal(id="buttons"):
                yield Button("Allow once (y)", variant="primary", id="once")
                yield Button("Allow for this chat (a)", variant="default", id="always")
                yield Button("Deny (n)", variant="error", id="deny")

    def on_mount(self) -> None:
        self.query_one("#reason", Input).display = False
        self.query_one("#once", Button).focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # while the reason is typed, y/a/n are letters of it
        if action in ("decide", "deny") and self.query_one("#reason", Input).has_focus:
            return parameters == ("deny",) or None
        return True

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "deny":
            self.action_deny()
        else:
            self.action_decide(str(event.button.id))

    def action_decide(self, decision: str) -> None:
        reason = self.query_one("#reason", Input).value.strip() if decision == "deny" else ""
        self.dismiss(Approval(decision, reason))  # type: ignore[arg-type]

    def action_deny(self) -> None:
        reason = self.query_one("#reason", Input)
        reason.display = True
        reason.focus()

    @on(Input.Submitted, "#reason")
    def reason_given(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(Approval("deny", event.value.strip()))
