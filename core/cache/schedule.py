"""The prefill schedule: where chunks end and which positions are capture points
(docs/DESIGN.md §7). Pure functions of lengths and boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence


def schedule_points(n: int, chunk: int, boundaries=(), fold: bool = False) -> list[int]:
    """The prefill schedule of a prompt of ``n`` tokens: sorted chunk ends.

    Bitwise schedule (``fold`` False), in ``(0, n - 1]``: every multiple of ``chunk`` below
    ``n - 1``, every message end (``boundaries``: ``(end_offset, role)``) below ``n - 1``,
    and ``n - 1`` itself (the last token is fed to decode, as mlx-lm's ``generate_step``
    does). A fixed function of the prompt: a cold run and a run restored at one of these
    points compute the same chunks after it, so their outputs are bit-identical.

    Folded schedule (``fold`` True, models without recurrent state), in ``(0, n]``: every
    multiple of ``chunk`` below ``n``, then ``n``: the last chunk includes the last prompt
    token and gives the first token's logits, one forward fewer per request; message ends
    are no chunk ends (a KV cache can be cut back anywhere, so a restore needs none).
    """
    if fold:
        return sorted({*range(chunk, n, chunk), n}) if n > 0 else []
    last = n - 1
    if last <= 0:
        return []
    points = set(range(chunk, last, chunk))
    points.update(end for end, _ in boundaries if 0 < end < last)
    points.add(last)
    return sorted(points)


def chunk_ends(start: int, points: Sequence[int], chunk: int = 0) -> list[int]:
    """The ends of the chunks that prefill from ``start``: the schedule points after it.

    ``chunk`` > 0 (the folded schedule, whose restores land anywhere): chunks of ``chunk``
    tokens counted from ``start`` up to the last point, so a turn of up to ``chunk`` new
    tokens is one forward, as mlx-lm's prefill steps count from its restore point.
    """
    if chunk > 0 and points:
        end = points[-1]
        return [*range(start + chunk, end, chunk), end] if start < end else []
    return [p for p in points if p > start]
