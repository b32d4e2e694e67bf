"""Layer adapters: what the prefix cache can take out of, and put back into, each cache class.

mlx-lm models keep one cache object per layer (``model.make_cache()``); some are nested
(``CacheList``). We flatten them into *leaves* named by their path ("3", "5.0", "5.1") and
give each leaf one small adapter according to its kind (docs/DESIGN.md §5):

- ``kv`` (sliceable): ``KVCache``, ``QuantizedKVCache``. A block stores its tokens' K/V slice;
  a prefix is the concatenation of its blocks' slices.
- ``window``: ``RotatingKVCache`` (sliding-window attention, ``keep == 0``). A block also
  stores its tokens' K/V slice; a restore at position P needs only the slices covering
  ``[P - max_size, P)`` and rebuilds the rotating buffer in temporal order. (Chosen over
  per-block window snapshots: a snapshot costs up to ``max_size + block_size - 1`` tokens of
  K/V per block, a slice ``block_size``.)
- ``state``: ``ArraysCache`` (SSM / GatedDeltaNet conv + recurrent state, fixed size).
  Only restorable from a snapshot taken exactly at that position.

Each kind is one adapter class (:class:`KVLeaf`, :class:`WindowLeaf`, :class:`StateLeaf`)
carrying its own protocol, in the spirit of mlx-lm's cache classes (``state``, ``trim``,
``is_trimmable``): what it captures for a block, how it is rebuilt at a position, and
whether the live cache of the last request can be cut back to a position in place.

Any other class makes the model unsupported (:class:`UnsupportedCache`): caching is turned
off for it rather than guessed at.

All functions here run on the engine thread (they build MLX graphs).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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

from ..memory.prefill import KV_STEP

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
    """One cache object inside the model's cache list. ``name`` is its path ("3" or "5.1").

    Subclasses implement one layer kind. ``slices``: a block stores its tokens' K/V slice;
    ``snapshots``: a position is restorable only from a snapshot taken there.
    """

    name: str
    kind: str
    cls: str
    max_size: int = 0  # window leaves: the sliding window, in tokens

    slices = False
    snapshots = False

    def span(self, c: Any, start: int, end: int) -> Arrays | None:
        """Views (no copy) of the K/V of absolute positions ``[start, end)`` in the live
        cache (slice kinds), or None when the cache does not hold them."""
        return None

    def capture(self, c: Any, start: int, end: int) -> Arrays | None:
        """A row-contiguous copy of :meth:`span`, or None."""
        got = self.span(c, start, end)
        return None if got is None else {n: _copy(a) for n, a in got.items()}

    def capture_blocks(self, c: Any, start: int, n: int, size: int) -> list[Arrays] | None:
        """The K/V of ``n`` consecutive blocks of ``size`` tokens from ``start``, one copy
        per array for all of them: a row-contiguous ``(n, B, H, size, D)`` array whose ``[i]``
        views are the blocks. One kernel per array per prefill chunk instead of one per block."""
        got = self.span(c, start, start + n * size)
        if got is None:
            return None
        stacks = {}
        for k, a in got.items():
            b, h, _, d = a.shape
            stacks[k] = mx.contiguous(a.reshape(b, h, n, size, d).transpose(2, 0, 1, 3, 4))
        return [{k: x[i] for k, x in stacks.items()} for i in range(n)]

    def snapshot(self, c: Any) -> Arrays:
        """The state at the cache's current position (state kinds)."""
        return {}

    def first_needed(self, position: int) -> int:
        """The first token position whose slice a restore at ``position`` needs."""
        return 0

    def restore(self, c: Any, parts: list[Arrays], position: int) -> None:
        """Fill a fresh cache object: from slices covering ``[first_needed(P), P)`` in
        order (slice kinds) or from ``parts[0]``, a snapshot taken at ``P`` (state kinds)."""
        raise NotImplementedError

    def can_cut(self, c: Any, length: int, position: int) -> bool:
        """Whether the live cache ``c``, holding ``length`` tokens, can be cut back to
        ``position`` in place, bit for bit what a restore at ``position`` would hold."""
        return position == length

    def cut(self, c: Any, length: int, position: int) -> None:
        """Cut the live cache back to ``position`` (after :meth:`can_cut` said yes)."""


def _trimmed_to(c: Any, position: int) -> None:
    if c.offset > position:
        c.trim(c.offset - position)


@dataclass(frozen=True)
class KVLeaf(Leaf):
    """``KVCache`` / ``QuantizedKVCache``: the K/V of every token, sliceable and trimmable.

    Slices are ``{"k": (B, n_kv_heads, T, head_dim), "v": ...}``; quantized caches give
    ``k0..k2``/``v0..v2`` (data, scales, biases), token axis 2 in each.
    """

    slices = True

    def span(self, c, start, end):
        if c.keys is None or end > c.offset:
            return None
        return {n: a[..., start:end, :] for n, a in _kv_parts(c)}

    def restore(self, c, parts, position, step: int = KV_STEP):
        # one concatenate per array, padded to a multiple of KVCache.step so the next
        # update writes in place instead of growing the buffer
        joined = {}
        for n in parts[0]:
            arrays = [p[n] for p in parts]
            pad = -sum(a.shape[2] for a in arrays) % step
            if pad:
                shape = list(arrays[0].shape)
                shape[2] = pad
                arrays.append(mx.zeros(shape, arrays[0].dtype))
            joined[n] = mx.concatenate(arrays, axis=2) if len(arrays) > 1 else mx.array(arrays[0])
        _set_kv(c, joined)
        c.offset = position

    @staticmethod
    def padded_length(position: int, step: int = KV_STEP) -> int:
        """The token axis of a buffer :meth:`restore` makes for ``position`` tokens."""
        return position + -position % step

    def adopt(self, c, joined: Arrays, position: int) -> None:
        """Fill a fresh cache with arrays already joined in token order, each ``(B,
        n_kv_heads, T, head_dim)`` with ``T`` a multiple of ``KV_STEP`` (256) of at least
        ``position`` and zeros after ``position`` (as :meth:`restore` makes them, or with
        room for more tokens), taken as they are, without a copy (the streamed fill of a
        restore, docs/DESIGN.md §9)."""
        _set_kv(c, joined)
        c.offset = position

    def can_cut(self, c, length, position):
        return c.keys is not None and position <= c.offset

    def cut(self, c, length, position):
        _trimmed_to(c, position)


@dataclass(frozen=True)
class WindowLeaf(Leaf):
    """``RotatingKVCache`` (sliding window, ``keep == 0``): the last ``max_size`` tokens.

    A block still stores its tokens' K/V slice; a restore at P rebuilds the buffer from the
    slices covering ``[P - max_size, P)``, in temporal order with ``_idx`` = its length, so
    the next chunk trims and attends exactly as the cold run's buffer would. The live
    buffer can be cut back in place only while it has never rotated (mlx-lm's
    ``is_trimmable``: ``offset < max_size``).
    """

    slices = True

    def span(self, c, start, end):
        if c.keys is None:
            return None
        keys, values = _temporal(c, c.keys), _temporal(c, c.values)
        first = c.offset - keys.shape[2]
        if start < first or end > c.offset:
            return None
        a, b = start - first, end - first
        return {"k": keys[..., a:b, :], "v": values[..., a:b, :]}

    def first_needed(self, position):
        return max(0, position - self.max_size)

    def restore(self, c, parts, position):
        joined = {}
        keep = min(position, self.max_size)
        for n in parts[0]:
            arrays = [p[n] for p in parts]
            x = mx.concatenate(arrays, axis=2) if len(arrays) > 1 else arrays[0]
            joined[n] = mx.array(x[..., x.shape[2] - keep :, :])
        _set_kv(c, joined)
        c.offset = position
        c._idx = c.keys.shape[2]

    def can_cut(self, c, length, position):
        if c.keys is None or position > c.offset:
            return False
        return position == c.offset or c.is_trimmable()

    def cut(self, c, length, position):
        _trimmed_to(c, position)


@dataclass(frozen=True)
class StateLeaf(Leaf):
    """``ArraysCache`` (SSM / GatedDeltaNet conv + recurrent state, fixed size): only
    restorable from a snapshot ``{"s0": ..., "s1": ...}`` taken exactly at the position
    (a missing slot is left out)."""

    snapshots = True

    def snapshot(self, c):
        return {f"s{i}": _copy(a) for i, a in enumerate(c.cache) if a is not None}

    def restore(self, c, parts, position):
        arrays = parts[0]
        c.cache = [
            mx.array(arrays[f"s{i}"]) if f"s{i}" in arrays else None for i in range(len(c.cache))
        ]


_ADAPTERS = {KIND_KV: KVLeaf, KIND_WINDOW: WindowLeaf, KIND_STATE: StateLeaf}


def make_leaf(name: str, kind: str, cls: str, max_size: int = 0) -> Leaf:
    return _ADAPTERS[kind](name, kind, cls, max_size)


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
    """Return the leaves of a fresh cache list as adapters of their kinds.

    Raises:
        UnsupportedCache: a leaf's class is unknown, or a window cache keeps tokens
            (``keep > 0``), whose buffer layout we do not rebuild.
    """
    leaves: list[Leaf] = []
    for name, c in iter_leaves(caches):
        cls = type(c).__name__
        if type(c) in (KVCache, QuantizedKVCache):
            leaves.append(make_leaf(name, KIND_KV, cls))
        elif type(c) is RotatingKVCache:
            if c.keep:
                raise UnsupportedCache(f"layer {name}: RotatingKVCache with keep={c.keep}")
            leaves.append(make_leaf(name, KIND_WINDOW, cls, c.max_size))
        elif type(c) is ArraysCache:
            leaves.append(make_leaf(name, KIND_STATE, cls))
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


def _set_kv(c: Any, joined: Arrays) -> None:
    if isinstance(c, QuantizedKVCache):
        c.keys = tuple(joined[f"k{i}"] for i in range(3))
        c.values = tuple(joined[f"v{i}"] for i in range(3))
    else:
        c.keys, c.values = joined["k"], joined["v"]


def _temporal(c: RotatingKVCache, x: mx.array) -> mx.array:
    """The rotating buffer ``x`` in temporal order: the last ``n`` tokens ending at offset."""
    idx = c._idx
    if idx == x.shape[2]:
        return x
    if idx < c.offset:
        return mx.concatenate([x[..., idx:, :], x[..., :idx, :]], axis=2)
    return x[..., :idx, :]


def leaf_map(caches: list[Any]) -> dict[str, Any]:
    return dict(iter_leaves(caches))


def arrays_nbytes(arrays: dict[str, mx.array]) -> int:
    return sum(a.nbytes for a in arrays.values())


Spec = dict[str, tuple[tuple[int, ...], Any]]


def probe_specs(leaves: Sequence[Leaf], caches: list[Any]) -> Spec:
    """Shapes and dtypes of every cached array, read off a cache that has seen >= 1 token.

    The token axis of slices is recorded as -1. Used to validate entries before restore.
    The caller may add ``spec[LOGPROBS]``, the first-token logprobs' ``((vocab,), dtype)``:
    without it no tail keeps them.
    """
    live = leaf_map(caches)
    spec: Spec = {}
    for leaf in leaves:
        c = live[leaf.name]
        if leaf.snapshots:
            for n, a in leaf.snapshot(c).items():
                spec[f"{leaf.name}.{n}"] = (tuple(a.shape), a.dtype)
        else:
            for n, a in leaf.capture(c, c.offset - 1, c.offset).items():
                shape = list(a.shape)
                shape[2] = -1
                spec[f"{leaf.name}.{n}"] = (tuple(shape), a.dtype)
    return spec
