"""Every key binding of the app (after the config file's keymap), with its id."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static


class HelpScreen(ModalScreen[None]):
    """``rows`` are ``(where, key, description, binding id)``."""

    CSS_PATH = "help.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,f1,q", "close", "Close", id="help_close")
    ]

    def __init__(self, rows: list[tuple[str, str, str, str]]) -> None:
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog") as dialog:
            dialog.border_title = "Keys"
            dialog.border_subtitle = "Esc closes · remap with \\[keymap] in config.toml"
            yield DataTable(cursor_type="row", zebra_stripes=True, id="help-table")
            yield Static(
                "Every action is also in the command palette (Ctrl+P). Click ◀ ▶ under a "
                "reply to swipe; click a message to select it.",
                classes="hint",
            )

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Where", "Key", "Action", "Binding id")
        for row in self.rows:
            table.add_row(*row)
        table.focus()

    def action_close(self) -> None:
        self.dismiss(None)
