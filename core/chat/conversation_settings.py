"""How a conversation generates: :class:`ConversationSettings`, saved with it in the store
(docs/DESIGN.md §12). Pure Python: the TUI's F9 dialog and ``chat``'s ``/set`` build them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..sampling_params import FIELDS, SamplingError, SamplingParams

SWIPE_TEMPERATURE = 0.8
"""A regenerate's temperature while the conversation's is 0, by default."""


@dataclass(frozen=True)
class ConversationSettings:
    """How a conversation generates. ``system``: the system prompt ("" for none; it
    replaces a system message stored at the root of the tree). ``sampling``: its
    :class:`~tierchat.core.sampling_params.SamplingParams` (their defaults and ranges).
    ``swipe_temperature`` (0..5): the temperature of a regenerate while
    ``sampling.temperature`` is 0 (0: regenerates stay greedy and repeat).

    Checked when made: raises :class:`~tierchat.core.sampling_params.SamplingError`
    naming the field."""

    system: str = ""
    sampling: SamplingParams = SamplingParams()
    swipe_temperature: float = SWIPE_TEMPERATURE

    def __post_init__(self) -> None:
        if not isinstance(self.system, str):
            raise SamplingError("system", "must be text")
        swipe = self.swipe_temperature
        if isinstance(swipe, bool) or not isinstance(swipe, int | float) or not 0 <= swipe <= 5:
            raise SamplingError("swipe_temperature", f"must be in 0..5, not {swipe}")
        object.__setattr__(self, "swipe_temperature", float(swipe))

    @classmethod
    def of(cls, **values: Any) -> ConversationSettings:
        """Settings from flat keys (``temperature=0.7, system="..."``): the sampling
        fields go to :attr:`sampling`. Raises ``TypeError`` for an unknown key,
        :class:`~tierchat.core.sampling_params.SamplingError` for a bad value."""
        return cls().with_values(values)

    def with_values(self, values: dict[str, Any]) -> ConversationSettings:
        """These settings with flat keys changed (``/set``, the F9 dialog). Raises
        ``TypeError`` for an unknown key, ``SamplingError`` for a bad value."""
        unknown = set(values) - set(FIELDS) - {"system", "swipe_temperature"}
        if unknown:
            raise TypeError(f"unknown setting {sorted(unknown)[0]}")
        sampling = SamplingParams.from_dict(values, self.sampling)
        own = {k: v for k, v in values.items() if k in ("system", "swipe_temperature")}
        return dataclasses.replace(self, sampling=sampling, **own)

    def to_dict(self) -> dict[str, Any]:
        """Flat keys, as the store keeps them: ``system``, each sampling field,
        ``swipe_temperature``."""
        return {
            "system": self.system,
            **self.sampling.to_dict(),
            "swipe_temperature": self.swipe_temperature,
        }

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], defaults: ConversationSettings
    ) -> ConversationSettings:
        """``data`` (as saved, flat keys) over ``defaults``; keys that are no setting are
        ignored (rows saved by older versions load), and a row with a bad value gives
        ``defaults``."""
        known = {k: v for k, v in data.items() if k in (*FIELDS, "system", "swipe_temperature")}
        if known.get("system") is None:
            known.pop("system", None)
        try:
            return defaults.with_values(known)
        except (TypeError, ValueError):
            return defaults


__all__ = ["SWIPE_TEMPERATURE", "ConversationSettings"]
