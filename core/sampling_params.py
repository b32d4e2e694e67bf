"""How one reply is sampled: :class:`SamplingParams`, the one record of the sampling
controls, with their one set of defaults and ranges (docs/DESIGN.md §2 "Sampling").

Pure Python (no MLX, no Textual): the engine reads it (``core/engine/sampling.py`` builds
mlx-lm's sampler and logits processors from it), and every place a request is made carries
it: a :class:`~tierchat.core.api.GenerateRequest`, a conversation's settings
(:class:`~tierchat.core.chat.conversation_settings.ConversationSettings`), the config file's sampling
keys (``config/settings.py``), serve's request bodies (``core/serve/prompts.py``). As in
vLLM's and SGLang's ``SamplingParams``, the record is frozen and checked once, when it is
made (``dataclasses.replace`` makes a new one, checked again): a value out of range raises
:class:`SamplingError` naming the field, which each caller shows in its own form (serve: a
400 in the API's shape; the TUI: under the F9 dialog; ``chat``: an ``error:`` line; the
config: a ``SettingsError`` with the key's source).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_STOP_STRINGS = 16  # Anthropic's limit (OpenAI's is 4)
MAX_STOP_CHARS = 200
MAX_TOKENS_LIMIT = 1 << 20  # the most tokens a reply may ask for (and top-k's bound)
SEED_LIMIT = 1 << 64  # seeds are 0 .. 2**64 - 1 (MLX's key is two uint32)


class SamplingError(ValueError):
    """A sampling value that cannot be used. ``field`` is the :class:`SamplingParams`
    field's name, ``problem`` what is wrong (``"must be in 0..5, not 7"``); the message is
    both (``"temperature must be in 0..5, not 7"``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


def _number(name: str, value: Any, kind: type, lo: float, hi: float, shown: str) -> Any:
    """``value`` as ``kind`` (an int for an int field; an int or float for a float field),
    within ``lo..hi`` (the caller checks open ends); raises :class:`SamplingError`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingError(name, f"must be {'an integer' if kind is int else 'a number'}")
    if kind is int and value != int(value):
        raise SamplingError(name, "must be an integer")
    if not lo <= value <= hi:  # NaN fails too
        raise SamplingError(name, f"must be in {shown}, not {value}")
    return kind(value)


@dataclass(frozen=True)
class SamplingParams:
    """The sampling controls of one reply; off (or greedy) at these defaults.

    - ``temperature`` 0..5 (0: greedy, the argmax); ``top_p`` (0, 1] (1: off); ``top_k``
      0 (off) .. 2**20; ``min_p`` [0, 1) (0: off): mlx-lm's ``make_sampler``.
    - ``repetition_penalty`` (0, 10] (1: off; multiplicative), ``presence_penalty`` and
      ``frequency_penalty`` -2..2 (0: off; additive): mlx-lm's
      ``make_logits_processors``; each looks back over the last
      ``repetition_context_size`` tokens (1 .. 2**20; mlx-lm's default 20), the prompt's
      included.
    - ``stop``: at most 16 strings of at most 200 characters; the reply ends before the
      first of them (finish reason "stop"); empty strings are dropped.
    - ``max_tokens``: 1 .. 2**20 tokens a reply may have.
    - ``seed``: None (unseeded) or 0 .. 2**64 - 1; used when ``temperature`` > 0.

    Raises :class:`SamplingError` (field and problem) for a value of the wrong type or out
    of range; ints are accepted for the float fields and kept as floats."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    max_tokens: int = 512
    seed: int | None = None

    def __post_init__(self) -> None:
        values = {
            "temperature": _number("temperature", self.temperature, float, 0.0, 5.0, "0..5"),
            "top_p": _number("top_p", self.top_p, float, 0.0, 1.0, "(0, 1]"),
            "top_k": _number("top_k", self.top_k, int, 0, MAX_TOKENS_LIMIT, "0 (off) .. 1048576"),
            "min_p": _number("min_p", self.min_p, float, 0.0, 1.0, "[0, 1)"),
            "repetition_penalty": _number(
                "repetition_penalty", self.repetition_penalty, float, 0.0, 10.0, "(0, 10]"
            ),
            "repetition_context_size": _number(
                "repetition_context_size",
                self.repetition_context_size,
                int,
                1,
                MAX_TOKENS_LIMIT,
                "1 .. 1048576",
            ),
            "presence_penalty": _number(
                "presence_penalty", self.presence_penalty, float, -2.0, 2.0, "-2..2"
            ),
            "frequency_penalty": _number(
                "frequency_penalty", self.frequency_penalty, float, -2.0, 2.0, "-2..2"
            ),
            "max_tokens": _number(
                "max_tokens", self.max_tokens, int, 1, MAX_TOKENS_LIMIT, "1 .. 1048576"
            ),
            "stop": _stop(self.stop),
            "seed": None
            if self.seed is None
            else _number("seed", self.seed, int, 0, SEED_LIMIT - 1, "0 .. 2**64 - 1 (or none)"),
        }
        if values["top_p"] == 0.0:
            raise SamplingError("top_p", "must be in (0, 1], not 0")
        if values["min_p"] == 1.0:
            raise SamplingError("min_p", "must be in [0, 1), not 1")
        if values["repetition_penalty"] == 0.0:
            raise SamplingError("repetition_penalty", "must be in (0, 10], not 0")
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax, whatever the other sampler settings."""
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values (``stop`` a list)."""
        out = dataclasses.asdict(self)
        out["stop"] = list(self.stop)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], defaults: SamplingParams | None = None):
        """``data``'s fields over ``defaults`` (default: the defaults); keys that are not
        fields are ignored. Raises :class:`SamplingError`."""
        base = defaults if defaults is not None else cls()
        return dataclasses.replace(base, **{k: v for k, v in data.items() if k in FIELDS})


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams))
"""The names of :class:`SamplingParams`' fields, in order (also the config file's keys)."""


def _stop(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str) or not isinstance(stop, list | tuple):
        raise SamplingError("stop", "must be a list of strings")
    if len(stop) > MAX_STOP_STRINGS or any(
        not isinstance(s, str) or len(s) > MAX_STOP_CHARS for s in stop
    ):
        raise SamplingError(
            "stop",
            f"must be at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters",
        )
    return tuple(s for s in stop if s)


__all__ = ["FIELDS", "SamplingError", "SamplingParams"]
