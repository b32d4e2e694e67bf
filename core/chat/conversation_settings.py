"""Per-conversation generation settings (docs/DESIGN.md §12), saved in the store with the
conversation: the system prompt, sampling, the reply's token budget, and the MCP servers
whose tools the conversation uses (docs/DESIGN.md §12.1)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..engine.sampling_checks import check_sampling


@dataclass(frozen=True)
class ConversationSettings:
    """How a conversation generates. ``system``: the system prompt ("" for none; it
    replaces a system message stored at the root of the tree). ``seed`` None: unseeded.
    ``top_k`` 0, ``min_p`` 0, ``repetition_penalty`` 1 and the presence and frequency
    penalties 0 are off; ``stop``: strings a reply ends before (core/engine/sampling.py). ``swipe_temperature``: the temperature of a
    regenerate while ``temperature`` is 0 (0: regenerates stay greedy and repeat).
    ``tools``: the MCP servers whose tools the model gets (names of ``mcp.json``);
    ``allowed_tools``: tools (``server.tool``) that run without asking in this
    conversation (docs/DESIGN.md §12.1)."""

    system: str = ""
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    swipe_temperature: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tools: tuple[str, ...] = ()
    allowed_tools: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("stop", "tools", "allowed_tools"):
            out[key] = list(getattr(self, key))
        return out

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], defaults: ConversationSettings
    ) -> ConversationSettings:
        """``data`` (as saved) over ``defaults``; unknown keys and bad values are ignored."""
        values = defaults.to_dict()
        for f in dataclasses.fields(cls):
            if f.name in data:
                values[f.name] = data[f.name]
        try:
            for key in ("stop", "tools", "allowed_tools"):
                v = values[key]
                if isinstance(v, str) or not all(isinstance(x, str) for x in v):
                    raise TypeError(f"{key} must be a list of strings")
            stop = values["stop"]
            out = cls(
                system=str(values["system"] or ""),
                temperature=float(values["temperature"]),
                top_p=float(values["top_p"]),
                top_k=int(values["top_k"]),
                min_p=float(values["min_p"]),
                repetition_penalty=float(values["repetition_penalty"]),
                stop=tuple(stop),
                max_tokens=int(values["max_tokens"]),
                seed=None if values["seed"] is None else int(values["seed"]),
                swipe_temperature=float(values["swipe_temperature"]),
                presence_penalty=float(values["presence_penalty"]),
                frequency_penalty=float(values["frequency_penalty"]),
                tools=tuple(values["tools"]),
                allowed_tools=tuple(values["allowed_tools"]),
            )
            return out.checked()
        except (TypeError, ValueError):
            return defaults

    @classmethod
    def saved(cls, store: Any, conversation_id: int, defaults: ConversationSettings):
        """The settings saved with ``conversation_id`` in ``store`` (a
        :class:`~tierchat.core.chat.store.ConversationStore`) over ``defaults``; a system
        message at the root of its tree is the default system prompt."""
        saved = store.conversation_settings(conversation_id)
        if "system" not in saved:
            root = store.selected_child(None, conversation_id)
            if root is not None and root.role == "system":
                defaults = dataclasses.replace(defaults, system=root.content)
        return cls.from_dict(saved, defaults)

    def checked(self) -> ConversationSettings:
        """Raises ``ValueError`` naming the first value out of range."""
        check_sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=self.stop,
        )
        if not 0.0 <= self.swipe_temperature <= 5.0:
            raise ValueError(f"swipe temperature must be in 0..5, not {self.swipe_temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"max tokens must be at least 1, not {self.max_tokens}")
        return self
