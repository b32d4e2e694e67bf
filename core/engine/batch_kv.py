"""Batch K/V caches that join in one copy (docs/DESIGN.md §11, §20).

A sequence joining the decode batch has the batch's caches copied: that copy is the
transient admission reserves (``core/memory/admission.py``: at a join the K/V of the
requests held is there twice). mlx-lm 0.32's ``BatchKVCache`` copies more than once:
``extend`` pads each side (``mx.pad``, a copy) and then concatenates them (a second), and
``merge`` sizes its arrays to exactly the longest row, so the step right after a join grows
them by concatenation (a third copy of the whole batch). Measured on ``tiny:llama`` with
~3.2K-token rows on the CPU, a join's peak was 1.5-1.6x the merged batch's K/V above what
was held, and 16 concurrent clients under ``--memory-limit`` overshot it by up to 13%.

:class:`OneCopyBatchKVCache` is ``BatchKVCache`` with ``merge`` and ``extend`` that write
every row once into one new array (:func:`place_rows`) sized with room for the next step,
so a join holds the old rows and one copy, as admission counts. Its layout, mask, ``filter``
and ``extract`` are ``BatchKVCache``'s: a row's attention reads positions
``[left_padding, _idx)`` only, so the numbers are those of ``BatchKVCache``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


def room(end: int, step: int) -> int:
    """Positions a batch array of ``end`` tokens is allocated with: ``end`` rounded up to a
    multiple of ``step`` with at least one free position (the next decode step's token
    is written in place, not by growing the array)."""
    return (end // step + 1) * step


def place_rows(
    parts: list[tuple[mx.array | None, int]], end: int, size: int, like: mx.array
) -> mx.array:
    """One ``(rows, heads, size, dim)`` array of ``like``'s dtype, heads and dim holding
    each of ``parts`` (an array ``(rows_i, heads, n_i, dim)`` or None for ``rows_i`` empty
    rows) right-aligned at position ``end``, the parts' rows stacked in order; zeros
    elsewhere. Each part is written once, in place (slice updates of a fresh array).

    Raises:
        ValueError: a part is longer than ``end``, or ``end`` > ``size``.
    """
    if end > size:
        raise ValueError(f"rows end at {end}, past the array's {size} positions")
    rows = sum(n for _, n in parts)
    out = mx.zeros((rows, like.shape[1], size, like.shape[3]), like.dtype)
    first = 0
    for x, n in parts:
        if x is not None and x.shape[2]:
            if x.shape[2] > end:
                raise ValueError(f"a part of {x.shape[2]} positions does not fit in {end}")
            out[first : first + n, :, end - x.shape[2] : end] = x
        first += n
    return out


class OneCopyBatchKVCache(BatchKVCache):
    """``BatchKVCache`` whose ``merge`` and ``extend`` copy each row once (see the module
    docstring). ``keys``, ``values``: ``(B, n_kv_heads, S, head_dim)``, ``S`` >= ``_idx``;
    row ``i``'s tokens are positions ``[left_padding[i], _idx)``."""

    @classmethod
    def merge(cls, caches: list[KVCache]) -> OneCopyBatchKVCache:
        """One batch cache of the one-row ``caches``, left-padded to the longest."""
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        out = cls([longest - n for n in lengths])
        if longest == 0:
            return out
        like = next(c for c in caches if c.keys is not None)
        size = room(longest, cls.step)

        def rows(name: str) -> mx.array:
            parts = []
            for c in caches:
                x = getattr(c, name)
                parts.append((x[..., : c.offset, :] if x is not None else None, 1))
            return place_rows(parts, longest, size, getattr(like, name))

        out.state = (rows("keys"), rows("values"), out.offset + longest, out.left_padding, longest)
        return out

    def extend(self, other: BatchKVCache) -> None:
        """Append ``other``'s rows (in place), both right-aligned at the longer ``_idx``."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        end = max(self._idx, other.size())
        size = room(end, self.step)
        sides = (self, other)

        def rows(name: str) -> mx.array:
            like = next(getattr(c, name) for c in sides if getattr(c, name) is not None)
            parts: list[tuple[Any, int]] = []
            for c in sides:
                x = getattr(c, name)
                parts.append((x[..., : c.size(), :] if x is not None else None, c.offset.shape[0]))
            return place_rows(parts, end, size, like)

        self.keys, self.values = rows("keys"), rows("values")
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate(
            [self.left_padding + (end - self._idx), other.left_padding + (end - other.size())]
        )
        self._idx = end
