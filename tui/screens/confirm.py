"""A yes/no modal for destructive actions (cache clears, deleting a conversation)."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ConfirmScreen(ModalScreen[bool]):
    """Dismisses with True on "y" / the confirm button, False on "n" / Esc / cancel."""

    CSS_PATH = "confirm.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "confirm", "Yes", id="confirm_yes"),
        Binding("n,escape", "cancel", "No", id="confirm_no"),
    ]

    def __init__(self, title: str, body: str, *, confirm_label: str = "Yes") -> None:
        super().__init__()
        self.title_text = title
        self.body = body
        self.confirm_label = confirm_label

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog") as dialog:
            dialog.border_title = self.title_text
            yield Static(self.body, id="body", markup=False)
            with Horizontal(id="buttons"):
                yield Button(f"{self.confirm_label} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", variant="default", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_confirm(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)


def confirm_clear(screen, tier: str, clear) -> None:
    """Ask before clearing ``tier`` (texts from :data:`~tierchat.tui.cache_report.
    CLEAR_TEXT`); call ``clear(tier)`` once the user confirms."""
    from tierchat.tui.cache_report import CLEAR_TEXT

    title, body = CLEAR_TEXT[tier]

    def done(confirmed: bool | None) -> None:
        if confirmed:
            clear(tier)

    screen.app.push_screen(ConfirmScreen(title, body, confirm_label="Clear"), done)
