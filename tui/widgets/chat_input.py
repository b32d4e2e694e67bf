"""The multi-line chat input: Enter sends, a second key inserts a newline (both remappable).

Newline keys: Ctrl+J (LF, which every terminal sends) and Alt+Enter (ESC CR, read as
Alt+Enter by ``tui/terminal.py``). Shift+Enter is bound too, but most terminals (tmux,
xterm, GNOME Terminal) send it as a plain CR, the same bytes as Enter; only terminals
speaking the kitty keyboard protocol tell the two apart.

Key order: the app checks priority bindings when it *reads* a key, but a typed character
reaches the TextArea later, through the input's own message queue. So "hi" + Enter in
one terminal read (tmux, expect scripts, a fast typist) would run the send binding before
"h" and "i" are in the text. The send action therefore only queues a :class:`SendRequest`
to the input itself, behind the characters; its handler reads the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from textual import on
from textual.binding import Binding, BindingType
from textual.message import Message
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
            "ctrl+j,alt+enter,shift+enter",
            "newline",
            "Newline (Shift+Enter: only terminals with the kitty keyboard protocol)",
            id="newline",
            priority=True,
            show=False,  # the placeholder names the keys; the footer keeps its room
        ),
        Binding("escape", "screen.select(-1)", "Messages", id="to_messages", show=False),
    ]

    @dataclass
    class SendRequest(Message):
        """Queued by the send key behind any characters typed before it."""

    @dataclass
    class NewlineRequest(Message):
        """Queued by the newline key behind any characters typed before it."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(
            "",
            id=id,
            soft_wrap=True,
            show_line_numbers=False,
            tab_behavior="focus",
            highlight_cursor_line=False,
            placeholder="Message… (Enter sends, Ctrl+J/Alt+Enter newline, F1 help)",
        )

    def on_mount(self) -> None:
        # Headless runs (tests, screenshots) must render the same frame every time.
        self.cursor_blink = not self.app.is_headless

    def action_send(self) -> None:
        self.post_message(self.SendRequest())

    def action_newline(self) -> None:
        self.post_message(self.NewlineRequest())

    @on(SendRequest)
    def _send(self, event: SendRequest) -> None:
        event.stop()
        text = self.text.strip()
        if text:
            self.post_message(MessageSubmitted(text))

    @on(NewlineRequest)
    def _newline(self, event: NewlineRequest) -> None:
        event.stop()
        self.insert("\n")
