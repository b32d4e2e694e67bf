"""The batch form of mlx-lm's ``QuantizedKVCache`` (``kv_bits``), so quantized-KV
sequences decode in one merged batch (docs/DESIGN.md §20, item 5; §5 for the cache kinds).

mlx-lm 0.32 has ``BatchKVCache`` for ``KVCache`` and ``BatchRotatingKVCache`` for
``RotatingKVCache`` but no batch form of ``QuantizedKVCache``, whose sequences therefore
decoded in one-row batches. :class:`BatchQuantizedKVCache` is ``BatchKVCache``'s layout
(rows left-padded to a common length ``end``, ``BatchKVCache``'s ``_idx``; ``offset`` and
``left_padding`` per row; a causal mask that hides each row's padding) over
``QuantizedKVCache``'s storage (keys and values each a ``(packed, scales, biases)``
triple from ``mx.quantize``, token axis 2). It carries ``bits`` and ``group_size``, so mlx-lm's attention
(``mlx_lm.models.base.scaled_dot_product_attention``) takes its quantized path for it, as
for the per-request cache.

Why a row equals the row alone: ``mx.quantize`` quantizes each token's head vector on its
own (groups along ``head_dim``), so a token's codes do not depend on the batch; a padded
position's score is masked to the dtype's minimum, whose softmax weight is exactly 0, so
it adds nothing to the row's output. What differs is only the length of the reductions
(float rounding), which the tests bound at 1e-4 on the logprobs
(``tests/engine/test_kv_bits_batch.py``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

from .batch_kv import OneCopyBatchKVCache, place_rows, room

Triple = tuple[mx.array, mx.array, mx.array]  # (packed, scales, biases), each (B, H, S, *)


class BatchQuantizedKVCache:
    """Quantized K/V of ``B`` left-padded sequences: ``keys``, ``values`` each a
    ``(packed (B, n_kv_heads, S, head_dim * bits / 32) uint32, scales, biases
    (B, n_kv_heads, S, head_dim / group_size))`` triple, ``S`` >= ``end`` (grown in steps
    of :attr:`step` tokens); row ``i``'s tokens are positions ``[left_padding[i], end)``;
    ``offset[i]`` is its token count (the RoPE position of its next token)."""

    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self.end = 0
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        """Quantize and append ``keys`` ``(B, n_kv_heads, L, k_head_dim)`` and ``values``
        (same, ``v_head_dim``) at every row's end; returns the quantized K and V of
        positions ``[0, end)``."""
        b, heads, n, k_dim = keys.shape
        prev = self.end
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            steps = (self.step + n - 1) // self.step * self.step
            fresh = (
                _zeros(b, heads, steps, k_dim, keys.dtype, self.group_size, self.bits),
                _zeros(b, heads, steps, values.shape[-1], keys.dtype, self.group_size, self.bits),
            )
            if self.keys is None:
                self.keys, self.values = fresh
            else:
                kept = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                self.keys, self.values = tree_map(
                    lambda x, y: mx.concatenate([x, y], axis=2), kept, fresh
                )
        self.end += n
        self.offset = self.offset + n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev : self.end, :] = qk[i]
            self.values[i][..., prev : self.end, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        return tree_map(lambda x: x[..., : self.end, :], (self.keys, self.values))

    def size(self) -> int:
        return self.end

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self.end

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self.end = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.end, n)
        self.end -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, n: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        """The boolean mask ``(B, 1, n, end + n)`` of ``n`` new tokens: causal, each
        row's padding hidden (as ``BatchKVCache.make_mask``; ``window_size`` passes on)."""
        return create_causal_mask(n, offset=self.end, left_padding=self.left_padding, **kwargs)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def filter(self, batch_indices: list[int] | mx.array) -> None:
        """Keep rows ``batch_indices`` (in place), dropping the padding no kept row needs."""
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(
                    lambda x: x[..., shift:, :], (self.keys, self.values)
                )
            self.end -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append ``other``'s rows (in place), both right-aligned at the longer ``end``.

        Raises:
            ValueError: the two quantize with other ``bits`` or ``group_size``.
        """
        _same_format([self, other])
        idx = max(self.end, other.end)
        like = self if self.keys is not None else other
        if like.keys is None:
            self.offset = mx.concatenate([self.offset, other.offset])
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            return

        # each row written once into one new array (core/engine/batch_kv.py)
        size = room(idx, self.step)

        def rows(part: int, j: int) -> mx.array:
            parts = []
            for c in (self, other):
                kv = (c.keys, c.values)[part]
                x = kv[j][..., : c.end, :] if kv is not None else None
                parts.append((x, c.offset.shape[0]))
            return place_rows(parts, idx, size, (like.keys, like.values)[part][j])

        self.keys, self.values = (tuple(rows(part, j) for j in range(3)) for part in (0, 1))
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate(
            [self.left_padding + (idx - self.end), other.left_padding + (idx - other.end)]
        )
        self.end = idx

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row ``idx`` as a request's own ``QuantizedKVCache`` of exactly its tokens."""
        pad = self.left_padding.tolist()[idx]
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is not None:
            cache.keys, cache.values = tree_map(
                lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self.end]),
                (self.keys, self.values),
            )
            cache.offset = self.end - pad
        return cache

    @classmethod
    def merge(cls, caches: list[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """One batch cache of the one-row ``caches``, left-padded to the longest.

        Raises:
            ValueError: the caches quantize with other ``bits`` or ``group_size``.
        """
        group, bits = _same_format(caches)
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        out = cls(padding, group_size=group, bits=bits)
        if longest == 0:
            return out
        like = next(c for c in caches if c.keys is not None)

        size = room(longest, cls.step)

        def rows(part: str, j: int) -> mx.array:
            parts = []
            for c in caches:
                kv = getattr(c, part)
                parts.append((kv[j][..., : c.offset, :] if kv is not None else None, 1))
            return place_rows(parts, longest, size, getattr(like, part)[j])

        out.keys, out.values = (
            tuple(rows(part, j) for j in range(3)) for part in ("keys", "values")
        )
        out.offset = out.offset + longest
        out.end = longest
        return out


def _zeros(b: int, heads: int, n: int, dim: int, dtype: Any, group: int, bits: int) -> Triple:
    per_word = 32 // bits
    return (
        mx.zeros((b, heads, n, dim // per_word), dtype=mx.uint32),
        mx.zeros((b, heads, n, dim // group), dtype=dtype),
        mx.zeros((b, heads, n, dim // group), dtype=dtype),
    )


def _same_format(caches: list[Any]) -> tuple[int, int]:
    formats = {(c.group_size, c.bits) for c in caches}
    if len(formats) != 1:
        raise ValueError(f"quantized KV caches of several formats cannot batch: {formats}")
    return formats.pop()


_BATCH_OF: dict[type, Any] = {
    QuantizedKVCache: BatchQuantizedKVCache.merge,
    KVCache: OneCopyBatchKVCache.merge,
}


def merge_of(cls: type) -> Any:
    """The function that merges one-row caches of class ``cls`` into a batch cache: this
    package's for ``KVCache`` (:mod:`.batch_kv`: joins in one copy) and
    ``QuantizedKVCache``, else the class's own ``merge`` (mlx-lm's); None when it has
    neither."""
    return _BATCH_OF.get(cls) or getattr(cls, "merge", None)


def merge_layer(caches: list[Any]) -> Any:
    """The batch cache of one layer of several sequences (a ``CacheList``'s members each
    merged by :func:`merge_of`, as ``CacheList.merge`` does with mlx-lm's classes)."""
    first = caches[0]
    if isinstance(first, CacheList):
        out = CacheList()
        out.caches = tuple(
            merge_layer([c.caches[i] for c in caches]) for i in range(len(first.caches))
        )
        return out
    return merge_of(type(first))(caches)
