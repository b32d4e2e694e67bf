"""Per-conversation settings: system prompt, temperature, top-p, max tokens and seed.

Saved in the store with the conversation (``ChatSession.save_settings``). A new
conversation starts from the config file's ``temperature``, ``top_p``, ``max_tokens`` and
``seed``. The note under the system prompt says what a change does to cache reuse: a new
system prompt is a new prefix, so the next turn prefills the whole conversation again
(the old prefix stays cached; switching back reuses it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static, TextArea
from tierchat.core.chat.session import ConversationSettings


class ConversationSettingsScreen(ModalScreen[ConversationSettings | None]):
    """Dismisses with the new settings (Ctrl+S), or None (Esc).

    ``reuse_note(system)`` returns the sentence about cache reuse for a system prompt.
    """

    CSS_PATH = "conversation_settings.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+s", "save", "Save", id="settings_save", priority=True),
        Binding("escape", "cancel", "Cancel", id="settings_cancel"),
    ]

    def __init__(
        self,
        settings: ConversationSettings,
        title: str,
        reuse_note: Callable[[str], str] | None = None,
        default_temperature: float | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.default_temperature = default_temperature
        self.title_text = title
        self.reuse_note = reuse_note

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(id="dialog") as dialog:
            dialog.border_title = f"Settings · {self.title_text}"
            yield Label("System prompt")
            yield TextArea(s.system, id="system", soft_wrap=True, tab_behavior="focus")
            yield Static("", id="reuse-note", markup=False)
            with Grid(id="numbers"):
                yield Label("Temperature (0 = greedy)")
                yield Input(f"{s.temperature:g}", id="temperature", type="number")
                yield Label("Top-p")
                yield Input(f"{s.top_p:g}", id="top_p", type="number")
                yield Label("Max tokens")
                yield Input(str(s.max_tokens), id="max_tokens", type="integer")
                yield Label("Seed (empty = unseeded)")
                yield Input("" if s.seed is None else str(s.seed), id="seed", type="integer")
            yield Static("", id="error", markup=False)
            default = (
                f" · new conversations start at temperature {self.default_temperature:g} "
                "(`temperature` in config.toml)"
                if self.default_temperature is not None
                else ""
            )
            yield Static(
                "Ctrl+S save · Esc cancel · at temperature > 0 each regenerate samples anew "
                f"(seed + reply number){default}",
                classes="hint",
                markup=False,
            )

    def on_mount(self) -> None:
        for widget in self.query(Input):
            widget.cursor_blink = not self.app.is_headless
        area = self.query_one("#system", TextArea)
        area.cursor_blink = not self.app.is_headless
        area.focus()
        self._update_note()

    @on(TextArea.Changed, "#system")
    def _system_changed(self) -> None:
        self._update_note()

    def _update_note(self) -> None:
        if self.reuse_note is None:
            return
        text = self.query_one("#system", TextArea).text.strip()
        try:
            note = self.reuse_note(text)
        except Exception as e:  # noqa: BLE001 - a note, never a crash
            note = f"(cannot tell the effect on reuse: {e})"
        self.query_one("#reuse-note", Static).update(note)

    def read(self) -> ConversationSettings:
        """The form as settings. Raises ``ValueError`` naming the bad field."""

        def value(wid: str) -> str:
            return self.query_one(f"#{wid}", Input).value.strip()

        try:
            temperature = float(value("temperature") or 0)
            top_p = float(value("top_p") or 1)
            max_tokens = int(value("max_tokens"))
        except ValueError:
            raise ValueError("temperature and top-p are numbers, max tokens an integer") from None
        seed_text = value("seed")
        try:
            seed = int(seed_text) if seed_text else None
        except ValueError:
            raise ValueError("the seed is an integer (or empty)") from None
        system = self.query_one("#system", TextArea).text.strip()
        return ConversationSettings(system, temperature, top_p, max_tokens, seed).checked()

    @dataclass
    class SaveRequest(Message):
        """Queued behind the keys the focused widget has not handled yet."""

    def action_save(self) -> None:
        # a priority key runs as it is read: let typed characters land first
        (self.focused or self).post_message(self.SaveRequest())

    @on(SaveRequest)
    def _save(self, event: SaveRequest) -> None:
        event.stop()
        try:
            settings = self.read()
        except ValueError as e:
            self.query_one("#error", Static).update(str(e))
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)
