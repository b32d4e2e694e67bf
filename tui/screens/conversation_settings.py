"""Per-conversation settings: system prompt, sampling (temperature, swipe temperature,
top-p, top-k, min-p, repetition, presence and frequency penalties, stop strings), max
tokens and seed.

Saved in the store with the conversation (``ChatSession.save_settings``). A new
conversation starts from the config file's ``temperature``, ``top_p``, ``max_tokens`` and
``seed``. The note under the system prompt says what a change does to cache reuse: a new
system prompt is a new prefix, so the next turn prefills the whole conversation again
(the old prefix stays cached; switching back reuses it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static, TextArea
from tierchat.core.chat.conversation_settings import ConversationSettings
from tierchat.core.sampling_params import SamplingParams

# the dialog's number fields: (label, setting, Input type); an empty field takes the default
FIELDS: tuple[tuple[str, str, str], ...] = (
    ("Temperature (0 greedy)", "temperature", "number"),
    ("Swipe temperature", "swipe_temperature", "number"),
    ("Top-p (1 off)", "top_p", "number"),
    ("Top-k (0 off)", "top_k", "integer"),
    ("Min-p (0 off)", "min_p", "number"),
    ("Repetition penalty", "repetition_penalty", "number"),
    ("Presence penalty", "presence_penalty", "number"),
    ("Frequency penalty", "frequency_penalty", "number"),
    ("Max tokens", "max_tokens", "integer"),
    ("Seed (empty: none)", "seed", "integer"),
)
DEFAULTS: dict[str, Any] = {
    **SamplingParams().to_dict(),
    "swipe_temperature": ConversationSettings().swipe_temperature,
}


def _shown(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:g}" if isinstance(value, float) else str(value)


def reuse_note(session: Any, system: str, current: ConversationSettings) -> str:
    """What a system prompt of ``system`` does to the next turn's cache reuse of the
    open conversation of ``session`` (a ``ChatSession``), whose settings are ``current``."""
    if system == current.system:
        return "System prompt unchanged: the next turn reuses the cached prefix."
    path = session.active_path()
    try:
        old = session.build_prompt(path, current)
        new = session.build_prompt(path, dataclasses.replace(current, system=system))
    except Exception:  # noqa: BLE001 - no model yet: say it in general terms
        return "A new system prompt is a new prefix: the next turn prefills from the start."
    shared = 0
    for a, b in zip(old.token_ids, new.token_ids, strict=False):
        if a != b:
            break
        shared += 1
    total = len(new.token_ids)
    return (
        f"New prefix: the prompt changes at token {shared} of {total}, so the next turn "
        f"prefills about {total - shared} tokens again. The old prefix stays cached; "
        "switching back reuses it."
    )


def format_stops(stops: tuple[str, ...]) -> str:
    """Stop strings as the form shows them: ``|`` between, a line break as ``\\n``."""
    return " | ".join(s.replace("\n", "\\n") for s in stops)


def parse_stops(text: str) -> tuple[str, ...]:
    """The form's stop strings: split at ``|``, ends stripped, ``\\n`` a line break."""
    parts = (p.strip().replace("\\n", "\n") for p in text.split("|"))
    return tuple(p for p in parts if p)


class ConversationSettingsScreen(ModalScreen[ConversationSettings | None]):
    """Dismisses with the new settings (Ctrl+S), or None (Esc).

    ``reuse_note(system)`` returns the sentence about cache reuse for a system prompt.
    ``servers``: the configured MCP servers; with any, a "Tools" field lists those
    enabled in the conversation (names separated by spaces or commas; docs/DESIGN.md
    §12.1).
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
        servers: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.servers = servers
        self.settings = settings
        self.values = {
            **settings.sampling.to_dict(),
            "swipe_temperature": settings.swipe_temperature,
        }
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
                for label, key, kind in FIELDS:
                    yield Label(label)
                    yield Input(_shown(self.values[key]), id=key, type=kind)
            yield Label("Stop strings (separated by |, \\n for a line break)")
            yield Input(format_stops(s.sampling.stop), id="stop")
            if self.servers:
                yield Label(f"Tools: MCP servers enabled here (of {', '.join(self.servers)})")
                yield Input(" ".join(s.tools), id="tools")
            yield Static("", id="error", markup=False)
            default = (
                f" · new conversations start at temperature {self.default_temperature:g} "
                "(`temperature` in config.toml)"
                if self.default_temperature is not None
                else ""
            )
            yield Static(
                "Ctrl+S save · Esc cancel · each regenerate samples anew (seed + reply "
                "number) at the temperature, or at the swipe temperature while it is 0"
                f"{default}",
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
        """The form as settings. Raises ``ValueError`` naming the bad field (a
        :class:`~tierchat.core.sampling_params.SamplingError` for a value out of range)."""
        values: dict[str, Any] = {}
        for label, key, kind in FIELDS:
            text = self.query_one(f"#{key}", Input).value.strip()
            if not text:
                values[key] = DEFAULTS[key]
                continue
            try:
                values[key] = int(text) if kind == "integer" else float(text)
            except ValueError:
                what = "an integer" if kind == "integer" else "a number"
                raise ValueError(f"{label}: {what}, not {text!r}") from None
        values["stop"] = parse_stops(self.query_one("#stop", Input).value)
        values["system"] = self.query_one("#system", TextArea).text.strip()
        if self.servers:  # no servers configured: the tools are kept as they are
            names = self.query_one("#tools", Input).value.replace(",", " ").split()
            unknown = [n for n in names if n not in self.servers]
            if unknown:
                raise ValueError(
                    f"no MCP server {unknown[0]!r} (configured: {', '.join(self.servers)})"
                )
            values["tools"] = tuple(n for n in self.servers if n in names)
        # the tools allowed without asking are not on this form: kept as they are
        return self.settings.with_values(values)

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
