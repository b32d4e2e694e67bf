"""Attention of short prefill chunks without a per-shape graph (MLX's CUDA backend).

MLX's CUDA backend runs a prefill's attention (query length > 1) through cuDNN SDPA, which
builds and caches one cuDNN graph per (query length, key length, strides)
(``SDPACacheKey`` in ``mlx/backend/cuda/scaled_dot_product_attention.cpp``). A chat turn
has new lengths on every request, so every turn pays a graph build: measured on an H100
(``shape:qwen2.5-0.5b``, a 20-400 token chunk after a ~4K-token context), 107-117 ms per
request with new lengths against 22 ms when the same lengths repeat.

For a short chunk the graph is the cost, not the arithmetic, so :func:`chunk_attention`
computes ``softmax(q kᵀ · scale + mask) v`` with plain MLX ops (matmul, softmax in float32
as MLX's own fallback does) when the chunk is at most ``max_query`` tokens and its score
matrix fits ``max_scores`` elements; longer chunks keep cuDNN (far faster there: a 32K
prefill takes 0.32 s with it and 1.49 s without). Same chunk shapes take the same path, so
a cold run and a cached run of one schedule compute the same numbers.

It applies only inside the ``with`` block, on the thread that runs it (the engine thread),
so mlx-lm's own generation in the same process (the bench's baseline) runs as it ships.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import mlx.core as mx

from .device import device_info

_fast_sdpa = mx.fast.scaled_dot_product_attention
_local = threading.local()


def _limits() -> tuple[int, int] | None:
    return getattr(_local, "limits", None)


def explicit_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """``softmax(q kᵀ · scale + mask) v`` with grouped-query heads, in MLX ops.

    ``q``: ``(B, n_heads, L, head_dim)``; ``k``, ``v``: ``(B, n_kv_heads, S, head_dim)``
    with ``n_heads`` a multiple of ``n_kv_heads``; ``mask``: ``"causal"`` (the last ``L``
    of ``S`` positions, bottom-right aligned as in ``mx.fast.scaled_dot_product_attention``),
    an additive or boolean array broadcastable to ``(B, n_heads, L, S)``, or None.
    Returns ``(B, n_heads, L, head_dim)`` in ``q``'s dtype.
    """
    b, n_heads, length, dim = q.shape
    n_kv, keys = k.shape[1], k.shape[2]
    rep = n_heads // n_kv
    scores = (q * scale).reshape(b, n_kv, rep, length, dim) @ k[:, :, None].swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}")
        visible = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None]
        scores = mx.where(visible, scores, mx.array(-mx.inf, scores.dtype))
    elif mask is not None:
        if mask.ndim == 4:  # (B, 1 or n_heads, L, S) -> the grouped scores' 5 axes
            heads = (n_kv, rep) if mask.shape[1] == n_heads else (1, 1)
            mask = mask.reshape(mask.shape[0], *heads, *mask.shape[2:])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        else:
            scores = scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ v[:, :, None]).reshape(b, n_heads, length, dim)


def _sdpa(q, k, v, *, scale, mask=None, sinks=None, **kwargs):
    limits = _limits()
    if limits is not None and sinks is None and not kwargs:
        max_query, max_scores = limits
        length = q.shape[2]
        scores = q.shape[0] * q.shape[1] * length * k.shape[2]
        if 1 < length <= max_query and scores <= max_scores:
            return explicit_attention(q, k, v, scale, mask)
    if sinks is not None:
        kwargs["sinks"] = sinks
    return _fast_sdpa(q, k, v, scale=scale, mask=mask, **kwargs)


@contextlib.contextmanager
def chunk_attention(max_query: int, max_scores: int = 1 << 28) -> Iterator[None]:
    """Within the block, on this thread, attention of chunks of 2 to ``max_query`` query
    tokens whose score matrix has at most ``max_scores`` elements runs as
    :func:`explicit_attention`; ``max_query`` 0 changes nothing."""
    if max_query <= 1:
        yield
        return
    if mx.fast.scaled_dot_product_attention is not _sdpa:
        mx.fast.scaled_dot_product_attention = _sdpa  # installed once; a no-op elsewhere
    before = _limits()
    _local.limits = (max_query, max_scores)
    try:
        yield
    finally:
        _local.limits = before


def default_max_query() -> int:
    """The ``chunk_attention`` setting's ``auto``: 512 query tokens on MLX's CUDA backend
    (where cuDNN SDPA builds a graph per shape), 0 (off) on Metal and the CPU."""
    return 512 if device_info().backend == "cuda" else 0
