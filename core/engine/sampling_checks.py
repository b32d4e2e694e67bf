"""Ranges of the sampling controls, checked where a request is made (the TUI's settings,
``tierchat chat``, serve's request bodies) with one message each. Pure Python (no MLX):
the TUI imports it through the session (docs/DESIGN.md §1)."""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 200


def check_sampling(
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    stop: Sequence[str] = (),
) -> None:
    """Raises ``ValueError`` naming the first value out of range (the UI, ``chat`` and
    serve's 400s say the same)."""
    if not 0.0 <= temperature <= 5.0:
        raise ValueError(f"temperature must be in 0..5, not {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top-p must be in (0, 1], not {top_p}")
    if top_k < 0:
        raise ValueError(f"top-k must be 0 (off) or more, not {top_k}")
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"min-p must be in [0, 1), not {min_p}")
    if not 0.0 < repetition_penalty <= 10.0:
        raise ValueError(f"repetition penalty must be in (0, 10], not {repetition_penalty}")
    for name, value in (("presence", presence_penalty), ("frequency", frequency_penalty)):
        if not -2.0 <= value <= 2.0:
            raise ValueError(f"{name} penalty must be in -2..2, not {value}")
    if len(stop) > MAX_STOP_STRINGS or any(
        not isinstance(s, str) or len(s) > MAX_STOP_CHARS for s in stop
    ):
        raise ValueError("stop: at most 4 strings of at most 200 characters")
