"""How a conversation generates: :class:`ConversationSettings`, saved with it in the store
(docs/DESIGN.md §12): the system prompt, sampling, and the MCP servers whose tools the
conversation uses (docs/DESIGN.md §12.1). Pure Python: the TUI's F9 dialog and ``chat``'s
``/set`` build them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..sampling_params import FIELDS, SamplingError, SamplingParams

SWIPE_TEMPERATURE = 0.8
"""A regenerate's temperature while the conversation's is 0, by default."""

OWN_FIELDS: tuple[str, ...] = ("system", "swipe_temperature", "tools", "allowed_tools")
"""The settings' own flat keys (the rest are :class:`SamplingParams` fields)."""

_NAME_LISTS = ("tools", "allowed_tools")


@dataclass(frozen=True)
class ConversationSettings:
    """How a conversation generates. ``system``: the system prompt ("" for none; it
    replaces a system message stored at the root of the tree). ``sampling``: its
    :class:`~tierchat.core.sampling_params.SamplingParams` (their defaults and ranges).
    ``swipe_temperature`` (0..5): the temperature of a regenerate while
    ``sampling.temperature`` is 0 (0: regenerates stay greedy and repeat).
    ``tools``: the MCP servers whose tools the model gets (names of ``mcp.json``);
    ``allowed_tools``: tools (``server.tool``) that run without asking in this
    conversation (docs/DESIGN.md §12.1).

    Checked when made: raises :class:`~tierchat.core.sampling_params.SamplingError`
    naming the field."""

    system: str = ""
    sampling: SamplingParams = SamplingParams()
    swipe_temperature: float = SWIPE_TEMPERATURE
    tools: tuple[str, ...] = ()
    allowed_tools: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.system, str):
            raise SamplingError("system", "must be text")
        swipe = self.swipe_temperature
        if isinstance(swipe, bool) or not isinstance(swipe, int | float) or not 0 <= swipe <= 5:
            raise SamplingError("swipe_temperature", f"must be in 0..5, not {swipe}")
        object.__setattr__(self, "swipe_temperature", float(swipe))
        for key in _NAME_LISTS:
            names = getattr(self, key)
            if isinstance(names, str) or not isinstance(names, list | tuple):
                raise SamplingError(key, "must be a list of strings")
            if not all(isinstance(n, str) for n in names):
                raise SamplingError(key, "must be a list of strings")
            object.__setattr__(self, key, tuple(names))

    @classmethod
    def of(cls, **values: Any) -> ConversationSettings:
        """Settings from flat keys (``temperature=0.7, system="..."``): the sampling
        fields go to :attr:`sampling`. Raises ``TypeError`` for an unknown key,
        :class:`~tierchat.core.sampling_params.SamplingError` for a bad value."""
        return cls().with_values(values)

    def with_values(self, values: dict[str, Any]) -> ConversationSettings:
        """These settings with flat keys changed (``/set``, the F9 dialog). Raises
        ``TypeError`` for an unknown key, ``SamplingError`` for a bad value."""
        unknown = set(values) - set(FIELDS) - set(OWN_FIELDS)
        if unknown:
            raise TypeError(f"unknown setting {sorted(unknown)[0]}")
        sampling = SamplingParams.from_dict(values, self.sampling)
        own = {k: v for k, v in values.items() if k in OWN_FIELDS}
        return dataclasses.replace(self, sampling=sampling, **own)

    def to_dict(self) -> dict[str, Any]:
        """Flat keys, as the store keeps them: ``system``, each sampling field,
        ``swipe_temperature``, ``tools`` and ``allowed_tools`` (lists)."""
        return {
            "system": self.system,
            **self.sampling.to_dict(),
            "swipe_temperature": self.swipe_temperature,
            "tools": list(self.tools),
            "allowed_tools": list(self.allowed_tools),
        }

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], defaults: ConversationSettings
    ) -> ConversationSettings:
        """``data`` (as saved, flat keys) over ``defaults``; keys that are no setting are
        ignored (rows saved by older versions load), and a row with a bad value gives
        ``defaults``."""
        known = {k: v for k, v in data.items() if k in (*FIELDS, *OWN_FIELDS)}
        if known.get("system") is None:
            known.pop("system", None)
        try:
            return defaults.with_values(known)
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


__all__ = ["OWN_FIELDS", "SWIPE_TEMPERATURE", "ConversationSettings"]
