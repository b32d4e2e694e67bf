"""Small text-entry modals: a one-line prompt (rename) and a message editor (edit a turn)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Static, TextArea


class PromptScreen(ModalScreen[str | None]):
    """One ``Input``; Enter dismisses with the stripped text (None when empty), Esc with None."""

    CSS_PATH = "prompt.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="prompt_cancel")
    ]

    def __init__(self, title: str, value: str = "", *, hint: str = "Enter to save · Esc to cancel"):
        super().__init__()
        self.title_text = title
        self.value = value
        self.hint = hint

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog") as dialog:
            dialog.border_title = self.title_text
            yield Input(self.value, id="prompt-input", select_on_focus=True)
            yield Static(self.hint, classes="hint", markup=False)

    def on_mount(self) -> None:
        self.query_one(Input).cursor_blink = not self.app.is_headless

    @on(Input.Submitted)
    def submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class EditMessageScreen(ModalScreen[str | None]):
    """A ``TextArea`` holding a user message; Ctrl+S dismisses with the new text."""

    CSS_PATH = "prompt.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+s", "save", "Send as new branch", id="edit_save", priority=True),
        Binding("escape", "cancel", "Cancel", id="edit_cancel"),
    ]

    def __init__(self, text: str, turn: int) -> None:
        super().__init__()
        self.text = text
        self.turn = turn

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog") as dialog:
            dialog.border_title = f"Edit message {self.turn + 1} (new branch)"
            yield TextArea(self.text, id="edit-area", soft_wrap=True, tab_behavior="focus")
            yield Static("Ctrl+S send as a new branch · Esc cancel", classes="hint")

    def on_mount(self) -> None:
        area = self.query_one(TextArea)
        area.cursor_blink = not self.app.is_headless
        area.move_cursor(area.document.end)  # to go on typing, as in the chat input
        area.focus()

    @dataclass
    class SaveRequest(Message):
        """Queued behind the keys the focused widget has not handled yet."""

    def action_save(self) -> None:
        # Ctrl+S is a priority binding, run as the key is read; characters typed just
        # before it are still in the TextArea's queue. Save once they are in.
        (self.focused or self).post_message(self.SaveRequest())

    @on(SaveRequest)
    def _save(self, event: SaveRequest) -> None:
        event.stop()
        text = self.query_one(TextArea).text.strip()
        self.dismiss(text or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
