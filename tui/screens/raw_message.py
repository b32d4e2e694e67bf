"""A message exactly as stored: its text in a read-only ``TextArea``, not rendered as
Markdown, so every character (``<br>``, ``*``, line breaks, a ``<think>`` part) shows,
and any part of it can be selected and copied (Ctrl+C, the app's clipboard path)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static, TextArea


class RawMessageScreen(ModalScreen[None]):
    """``text`` read-only; ``title`` names the message. Esc or q closes; ``a`` copies
    the whole text."""

    CSS_PATH = "raw_message.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "close", "Close", id="raw_close"),
        Binding("a", "copy_all", "Copy all", id="raw_copy_all"),
    ]

    def __init__(self, text: str, title: str) -> None:
        super().__init__()
        self.text = text
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog") as dialog:
            dialog.border_title = self.title_text
            lines = self.text.count("\n") + 1
            dialog.border_subtitle = f"{len(self.text):,} characters · {lines:,} lines"
            yield TextArea(
                self.text,
                id="raw-text",
                read_only=True,
                soft_wrap=True,
                show_line_numbers=True,
                highlight_cursor_line=False,
            )
            yield Static(
                "Shift+arrows select · Ctrl+C copy selection · a copy all · Esc close",
                classes="hint",
            )

    def on_mount(self) -> None:
        area = self.query_one(TextArea)
        area.cursor_blink = not self.app.is_headless
        area.focus()

    def action_copy_all(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.notify(f"Copied {len(self.text)} characters.", timeout=3)

    def action_close(self) -> None:
        self.dismiss(None)
