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

History: ↑ on the first line recalls the previous prompt (the user messages the screen's
``prompt_history`` gives, oldest first), ↓ on the last line the next, then the draft again.
"""

from __future__ import annotations

from collections.abc import Callable
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
        Binding("escape", "to_messages", "Messages", id="to_messages", show=False),
        # on the first (last) line, ↑ (↓) recall earlier (later) prompts; elsewhere they
        # move the cursor as in any TextArea
        Binding("up", "recall(-1)", "Earlier prompt", id="recall_prev", show=False),
        Binding("down", "recall(1)", "Later prompt", id="recall_next", show=False),
    ]

    prompt_history: Callable[[], list[str]] | None = None
    """The prompts ↑ walks back through, oldest first (set by the screen)."""

    @dataclass
    class SendRequest(Message):
        """Queued by the send key behind any characters typed before it."""

    @dataclass
    class NewlineRequest(Message):
        """Queued by the newline key behind any characters typed before it."""

    @dataclass
    class ToMessages(Message):
        """Esc in the input: the user goes to the messages (the widget holding the input
        and the transcript moves the message cursor there)."""

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
        self._recalled: list[str] | None = None  # the history while recalling
        self._recall_at = 0  # index into it; len() is the draft
        self._draft = ""

    def action_recall(self, delta: int) -> None:
        """↑/↓ at the first/last line: the previous/next prompt of :attr:`prompt_history` (the
        draft typed before comes back after the newest); elsewhere, a cursor move."""
        row = self.cursor_location[0]
        edge = row == 0 if delta < 0 else row == self.document.line_count - 1
        if not edge or (self._recalled is None and delta > 0) or self.prompt_history is None:
            (self.action_cursor_up if delta < 0 else self.action_cursor_down)()
            return
        if self._recalled is None:
            self._recalled = [t for t in self.prompt_history() if t.strip()]
            self._recall_at, self._draft = len(self._recalled), self.text
        at = self._recall_at + delta
        if not 0 <= at <= len(self._recalled):
            return
        self._recall_at = at
        text = self._recalled[at] if at < len(self._recalled) else self._draft
        if at == len(self._recalled):
            self._recalled = None  # back at the draft: typing ends the walk
        self.load_text(text)
        self.move_cursor(self.document.end if delta > 0 else (0, len(text.split("\n")[0])))

    def forget_recall(self) -> None:
        """Typing or sending ends a walk through the history."""
        self._recalled = None

    def action_send(self) -> None:
        self.post_message(self.SendRequest())

    def action_to_messages(self) -> None:
        self.post_message(self.ToMessages())

    def action_newline(self) -> None:
        self.post_message(self.NewlineRequest())

    @on(SendRequest)
    def _send(self, event: SendRequest) -> None:
        event.stop()
        text = self.text.strip()
        if text:
            self.forget_recall()
            self.post_message(MessageSubmitted(text))

    @on(NewlineRequest)
    def _newline(self, event: NewlineRequest) -> None:
        event.stop()
        self.insert("\n")
