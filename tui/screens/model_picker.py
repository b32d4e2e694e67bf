"""Pick a model to load on the engine: built-ins, local MLX directories, or a typed path."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import Option
from tierchat.tui.models import ModelChoice


class ModelPickerScreen(ModalScreen[str | None]):
    """Dismisses with the chosen model spec, or None on Esc."""

    CSS_PATH = "model_picker.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="picker_cancel")
    ]

    def __init__(self, choices: list[ModelChoice], current: str) -> None:
        super().__init__()
        self.choices = choices
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog") as dialog:
            dialog.border_title = "Load a model"
            options = []
            for choice in self.choices:
                mark = "●" if choice.spec == self.current else " "
                prompt = f"{mark} [b]{escape(choice.spec)}[/b]  [dim]{escape(choice.note)}[/]"
                options.append(Option(prompt, id=choice.spec))
            yield OptionList(*options, id="model-options")
            yield Input(
                placeholder="or a local MLX directory / Hugging Face repo id", id="model-path"
            )
            yield Static(
                "Enter loads on the engine thread · Esc cancels · random-weight test "
                "models (tiny:llama, tiny:gemma3, …) load when typed by name",
                classes="hint",
            )

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        specs = [c.spec for c in self.choices]
        options.highlighted = specs.index(self.current) if self.current in specs else 0
        self.query_one(Input).cursor_blink = not self.app.is_headless
        options.focus()

    @on(OptionList.OptionSelected)
    def chosen(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    @on(Input.Submitted)
    def typed(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)
