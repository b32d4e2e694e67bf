"""The multi-line chat input: Enter sends, a second key inserts a newline (both remappable)."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.widgets import TextArea
from tierchat.tui.messages import MessageSubmitted


class ChatInput(TextArea):
    """A ``TextArea`` whose send and newline keys are priority bindings with ids.

    Priority lets "enter" reach :meth:`action_send` before ``TextArea`` inserts a newline;
    the ids ("send", "newline") let the config file's keymap move either key.
    """

    DEFAULT_CSS = """
    ChatInput {
        height: auto;
        min-height: 3;
        max-height: 10;
        border: round $primary 50%;
        padding: 0 1;
    }
    ChatInput:focus {
        border: round $primary;
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "send", "Send", id="send", priority=True),
        Binding(
            "shift+enter,ctrl+j", "newline", "Newline", id="newline", priority=True, show=False
        ),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(
            "",
            id=id,
            soft_wrap=True,
            show_line_numbers=False,
            tab_behavior="focus",
            highlight_cursor_line=False,
            placeholder="Message…  (Enter sends, Ctrl+J newline, F1 help)",
        )

    def on_mount(self) -> None:
        # Headless runs (tests, screenshots) must render the same frame every time.
        self.cursor_blink = not self.app.is_headless

    def action_send(self) -> None:
        text = self.text.strip()
        if text:
            self.post_message(MessageSubmitted(text))

    def action_newline(self) -> None:
        self.insert("\n")
