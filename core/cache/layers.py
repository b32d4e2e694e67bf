"""Layer adapters: what the prefix cache can take out of, and put back into, each cache class.

mlx-lm models keep one cache object per layer (``model.make_cache()``); some are nested
(``CacheList``). We flatten them into *leaves* named by their path ("3", "5.0", "5.1") and
give each leaf one small adapter according to its kind (DESIGN.md §5):

- ``kv`` (sliceable): ``KVCache``, ``QuantizedKVCache``. A block stores its tokens' K/V slice;
  a prefix is the concatenation of its blocks' slices.
- ``window``: ``RotatingKVCache`` (sliding-window attention, ``keep == 0``). A block also
  stores its tokens' K/V slice; a restore at position P needs only the slices covering
  ``[P - max_size, P)`` and rebuilds the rotating buffer in temporal order. (Chosen over
  per-block window snapshots: a snapshot costs up to ``max_size + block_size - 1`` tokens of
  K/V per block, a slice ``block_size``.)
- ``state``: ``ArraysCache`` (SSM / GatedDeltaNet conv + recurrent state, fixed size).
  Only restorable from a snapshot taken exactly at that position.

Any other class makes the model unsupported (:class:`UnsupportedCache`): caching is turned
off for it rather than guessed at.

All functions here run on the engine thread (they build MLX graphs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

KIND_KV = "kv"
KIND_WINDOW = "window"
KIND_STATE = "state"

Arrays = dict[str, mx.array]


class UnsupportedCache(Exception):
    """A layer's cache class is not one the prefix cache knows how to slice or snapshot."""


def _copy(x: mx.array) -> mx.array:
    # A row-contiguous copy: slices of the live (B, H, T, D) buffer are strided views that
    # would pin the whole buffer; and the SSD tier writes raw row-major bytes.
    return mx.contiguous(x)


@dataclass(frozen=True)
class Leaf:
    """One cache object inside the model's cache list. ``name`` is its path ("3" or "5.1")."""

    name: str
    kind: str
    cls: str
    max_size: int = 0  # window leaves: the sliding window, in tokens


def iter_leaves(caches: list[Any]) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, cache)`` for every non-list cache object, depth first."""

    def walk(prefix: str, c: Any):
        if isinstance(c, CacheList):
            for i, child in enumerate(c.caches):
                yield from walk(f"{prefix}.{i}", child)
        else:
            yield prefix, c

    for i, c in enumerate(caches):
        yield from walk(str(i), c)


def classify(caches: list[Any]) -> tuple[Leaf, ...]:
    """Return the leaves of a fresh cache list with their kinds.

    Raises:
        UnsupportedCache: a leaf's class is unknown, or a window cache keeps tokens
            (``keep > 0``), whose buffer layout we do not rebuild.
    """
    leaves = []
    for name, c in iter_leaves(caches):
        cls = type(c).__name__
        if type(c) in (KVCache, QuantizedKVCache):
            leaves.append(Leaf(name, KIND_KV, cls))
        elif type(c) is RotatingKVCache:
            if c.keep:
                raise UnsupportedCache(f"layer {name}: RotatingKVCache with keep={c.keep}")
            leaves.append(Leaf(name, KIND_WINDOW, cls, c.max_size))
        elif type(c) is ArraysCache:
            leaves.append(Leaf(name, KIND_STATE, cls))
        else:
            raise UnsupportedCache(f"layer {name}: cache class {cls} is not supported")
    return tuple(leaves)


def _kv_parts(c: Any) -> list[tuple[str, mx.array]]:
    """The arrays of a KV-like cache whose axis 2 is the token axis, with short names."""
    if isinstance(c, QuantizedKVCache):
        return [(f"k{i}", a) for i, a in enumerate(c.keys)] + [
            (f"v{i}", a) for i, a in enumerate(c.values)
        ]
    return [("k", c.keys), ("v", c.values)]


def _temporal(c: RotatingKVCache, x: mx.array) -> mx.array:
    """The rotating buffer ``x`` in temporal order: the last ``n`` tokens ending at offset."""
    idx = c._idx
    if idx == x.shape[2]:
        return x
    if idx < c.offset:
        return mx.concatenate([x[..., idx:, :], x[..., :idx, :]], axis=2)
    return x[..., :idx, :]


def capture_slice(leaf: Leaf, c: Any, start: int, end: int) -> Arrays | None:
    """Copy the K/V of absolute token positions ``[start, end)`` out of a live cache.

    Returns ``{"k": (B, n_kv_heads, end - start, head_dim), "v": ...}`` (quantized caches:
    ``k0..k2``/``v0..v2`` for data, scales, biases), or None when a window cache no longer
    holds those positions.
    """
    if c.keys is None:
        return None
    if leaf.kind == KIND_KV:
        return {n: _copy(a[..., start:end, :]) for n, a in _kv_parts(c)}
    # window: the buffer holds the last n tokens before c.offset, maybe rotated
    keys, values = _temporal(c, c.keys), _temporal(c, c.values)
    first = c.offset - keys.shape[2]
    if start < first or end > c.offset:
        return None
    a, b = start - first, end - first
    return {"k": _copy(keys[..., a:b, :]), "v": _copy(values[..., a:b, :])}


def snapshot(leaf: Leaf, c: Any) -> Arrays:
    """Copy a state leaf's arrays (``s0``, ``s1``, ...; a missing slot is left out)."""
    return {f"s{i}": _copy(a) for i, a in enumerate(c.cache) if a is not None}


def restore_kv(leaf: Leaf, c: Any, parts: list[Arrays], position: int, step: int = 256) -> None:
    """Fill a fresh KV/window leaf from slices covering ``[P - n, P)`` in order.

    KV leaves get every slice from position 0 concatenated once, padded to a multiple of
    ``KVCache.step`` so the next update writes in place. Window leaves keep the last
    ``min(P, max_size)`` tokens in temporal order (``_idx`` = that length): the next chunk
    then trims and attends exactly as the cold run's buffer would.
    """
    names = list(parts[0])
    joined = {}
    for n in names:
        arrays = [p[n] for p in parts]
        if leaf.kind == KIND_KV:
            total = sum(a.shape[2] for a in arrays)
            pad = -total % step
            if pad:
                shape = list(arrays[0].shape)
                shape[2] = pad
                arrays.append(mx.zeros(shape, arrays[0].dtype))
            joined[n] = mx.concatenate(arrays, axis=2) if len(arrays) > 1 else mx.array(arrays[0])
        else:
            x = mx.concatenate(arrays, axis=2) if len(arrays) > 1 else arrays[0]
            keep = min(position, leaf.max_size)
            joined[n] = mx.array(x[..., x.shape[2] - keep :, :])
    if isinstance(c, QuantizedKVCache):
        c.keys = tuple(joined[f"k{i}"] for i in range(3))
        c.values = tuple(joined[f"v{i}"] for i in range(3))
    else:
        c.keys, c.values = joined["k"], joined["v"]
    c.offset = position
    if leaf.kind == KIND_WINDOW:
        c._idx = c.keys.shape[2]


def restore_state(leaf: Leaf, c: Any, arrays: Arrays) -> None:
    """Put a snapshot back into a fresh ``ArraysCache``."""
    c.cache = [
        mx.array(arrays[f"s{i}"]) if f"s{i}" in arrays else None for i in range(len(c.cache))
    ]


def leaf_map(caches: list[Any]) -> dict[str, Any]:
    return dict(iter_leaves(caches))


def arrays_nbytes(arrays: dict[str, mx.array]) -> int:
    return sum(a.nbytes for a in arrays.values())
