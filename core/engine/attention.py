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

On the CPU the same path runs every attention (prefill chunks and decode steps), for
another reason: MLX's CPU ``exp`` (inside its ``softmax`` and its SDPA fallback) is a
scalar polynomial, and a chunk's softmax over a long context is most of a small model's
prefill. ``libm``'s ``pow`` is faster: measured on this project's 2-core x86 machine,
``mx.power(e, x)`` takes 2.8 ms for 500K scores against 7.1 ms for ``mx.exp(x)``, with a
largest relative error of 1.3e-6 against float64 (``exp``'s: 1.8e-6). So the softmax
there is ``power(e, s - max)`` normalised (:func:`pow_softmax`), when a probe at first
use says ``pow`` is the faster of the two on this machine (:func:`pow_is_faster`).

It applies only inside the ``with`` block, on the thread that runs it (the engine thread),
so mlx-lm's own generation in the same process (the bench's baseline) runs as it ships.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..device import device_info
from ..files import private_dirs, temp_file

_fast_sdpa = mx.fast.scaled_dot_product_attention
_local = threading.local()


Softmax = Callable[[mx.array], mx.array]

ALL_QUERIES = 1 << 30  # ``max_query`` of a plan that takes every query length


def mlx_softmax(scores: mx.array) -> mx.array:
    """MLX's own softmax over the last axis, computed in float32 (``precise``)."""
    return mx.softmax(scores, axis=-1, precise=True)


def pow_softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis as ``e ** (s - max(s))`` normalised, in float32, returned
    in ``scores``' dtype. The same formula as :func:`mlx_softmax` with ``libm``'s ``pow``
    in place of MLX's ``exp`` (see the module doc); a row of all ``-inf`` gives NaN, as
    ``mx.softmax`` does."""
    s = scores.astype(mx.float32)
    shifted = s - mx.max(s, axis=-1, keepdims=True)
    p = mx.power(mx.array(math.e, dtype=mx.float32), shifted)
    return (p / mx.sum(p, axis=-1, keepdims=True)).astype(scores.dtype)


@functools.cache
def pow_is_faster(elements: int = 1 << 19, repeats: int = 3) -> bool:
    """Whether ``mx.power(e, x)`` beats ``mx.exp(x)`` on the CPU for ``elements`` float32
    values in [-30, 0] (best of ``repeats``; about 20 ms, once per process)."""
    with mx.stream(mx.cpu):
        x = mx.random.uniform(-30.0, 0.0, (elements,), key=mx.random.key(0))
        base = mx.array(math.e, dtype=mx.float32)
        mx.eval(x, base)

        def best(fn: Callable[[], mx.array]) -> float:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                mx.eval(fn())
                times.append(time.perf_counter() - t0)
            return min(times)

        return best(lambda: mx.power(base, x)) < best(lambda: mx.exp(x))


@dataclass(frozen=True)
class AttentionPlan:
    """Which attentions run as :func:`explicit_attention`: query lengths from
    ``min_query`` to ``max_query`` whose score matrix has at most ``max_scores`` elements,
    with ``softmax``. ``max_query`` 0: none (MLX's fast kernel everywhere)."""

    max_query: int = 0
    min_query: int = 2
    max_scores: int = 1 << 28
    softmax: Softmax = mlx_softmax
    fused: bool = False  # MLX's fast SDPA holds no score matrix for 16-bit inputs (CUDA)

    def takes(self, batch: int, heads: int, length: int, keys: int) -> bool:
        """Whether an attention of these sizes runs as :func:`explicit_attention`."""
        scores = batch * heads * length * keys
        return self.min_query <= length <= self.max_query and scores <= self.max_scores

    def materializes(self, heads: int, length: int, keys: int, dtype_bytes: int) -> bool:
        """Whether a prefill chunk of ``length`` queries over ``keys`` keys holds its score
        matrices in memory: when it runs as :func:`explicit_attention`, or through MLX's
        fast SDPA where that is not one fused kernel (the CPU backend, float32 inputs;
        Metal is counted as materializing too: an upper bound there). On CUDA 16-bit
        inputs go to cuDNN's fused attention: counted as three float32 copies, a
        2,048-token chunk at 78K tokens of Qwen3-8B reserved 61 GB that an H200 never
        held (its MLX peak 46 GB, weights and caches included)."""
        return self.takes(1, heads, length, keys) or not (self.fused and dtype_bytes < 4)


OFF = AttentionPlan()


def remembered_pow(choice_file: Path | None, probe: Callable[[], bool] | None = None) -> bool:
    """Whether to use :func:`pow_softmax`: the choice written in ``choice_file``
    (``{"pow_softmax": bool}``) when it holds one, else ``probe()``, written there (0600,
    atomically) for the next process. The cache's entries are keyed by the softmax
    (docs/DESIGN.md §7), so a probe timed afresh under another load after a restart would
    put the restarted server in another cache folder: its SSD tier lost. A file that
    cannot be read or written is probed (and the choice kept for this process only).
    ``None``: probe. ``probe``: default :func:`pow_is_faster`."""
    probe = probe or pow_is_faster
    if choice_file is None:
        return probe()
    try:
        value = json.loads(choice_file.read_text()).get("pow_softmax")
        if isinstance(value, bool):
            return value
    except (OSError, ValueError, AttributeError):
        pass
    value = probe()
    try:
        private_dirs(choice_file.parent)
        with temp_file(choice_file) as tmp:
            tmp.write_text(json.dumps({"pow_softmax": value}))
            os.replace(tmp, choice_file)
    except OSError:
        pass
    return value


def plan_attention(
    max_query: int | None, backend: str | None = None, choice_file: Path | None = None
) -> AttentionPlan:
    """The plan for the ``chunk_attention`` setting (``max_query``; None: auto) on
    ``backend`` (default: this process's). CUDA: prefill chunks of 2 to ``max_query``
    (auto 512) tokens with MLX's softmax. CPU: every attention up to ``max_query`` query
    tokens (auto: all of them, decode steps included) with :func:`pow_softmax` where
    :func:`pow_is_faster`, as first measured for ``choice_file`` (:func:`remembered_pow`).
    Metal: auto is off. ``max_query`` 0 is off everywhere."""
    backend = backend or device_info().backend
    if backend == "cpu":
        if max_query == 0:
            return OFF
        softmax = pow_softmax if remembered_pow(choice_file) else mlx_softmax
        limit = ALL_QUERIES if max_query is None else max_query
        return AttentionPlan(max_query=limit, min_query=1, softmax=softmax)
    fused = backend == "cuda"
    if max_query is None:
        max_query = 512 if fused else 0
    if max_query <= 1:
        return AttentionPlan(fused=True) if fused else OFF
    return AttentionPlan(max_query=max_query, fused=fused)


def _plan() -> AttentionPlan | None:
    return getattr(_local, "plan", None)


def explicit_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | str | None,
    softmax: Softmax = mlx_softmax,
) -> mx.array:
    """``softmax(q kᵀ · scale + mask) v`` with grouped-query heads, in MLX ops.

    ``q``: ``(B, n_heads, L, head_dim)``; ``k``, ``v``: ``(B, n_kv_heads, S, head_dim)``
    with ``n_heads`` a multiple of ``n_kv_heads`` (``v``'s head size may differ from
    ``q``'s and ``k``'s, as in DeepSeek-V2's attention); ``mask``: ``"causal"`` (the last ``L``
    of ``S`` positions, bottom-right aligned as in ``mx.fast.scaled_dot_product_attention``),
    an additive or boolean array broadcastable to ``(B, n_heads, L, S)``, or None.
    ``softmax``: over the scores' last axis (:func:`mlx_softmax` or :func:`pow_softmax`).
    Returns ``(B, n_heads, L, v_head_dim)`` in ``q``'s dtype.
    """
    b, n_heads, length, dim = q.shape
    n_kv, keys = k.shape[1], k.shape[2]
    rep = n_heads // n_kv
    scores = (q * scale).reshape(b, n_kv, rep, length, dim) @ k[:, :, None].swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}")
        # an additive (L, S) mask: one add over the scores, where a select over all of
        # them costs as much as the softmax on the CPU (same values: s + 0 = s)
        visible = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None]
        zero, minus_inf = mx.array(0, scores.dtype), mx.array(-mx.inf, scores.dtype)
        scores = scores + mx.where(visible, zero, minus_inf)
    elif mask is not None:
        if mask.ndim == 4:  # (B, 1 or n_heads, L, S) -> the grouped scores' 5 axes
            heads = (n_kv, rep) if mask.shape[1] == n_heads else (1, 1)
            mask = mask.reshape(mask.shape[0], *heads, *mask.shape[2:])
        if mask.dtype == mx.bool_:  # made additive at the mask's own size, then added
            zero, minus_inf = mx.array(0, scores.dtype), mx.array(-mx.inf, scores.dtype)
            mask = mx.where(mask, zero, minus_inf)
        scores = scores + mask
    weights = softmax(scores)
    return (weights @ v[:, :, None]).reshape(b, n_heads, length, v.shape[-1])


def _sdpa(q, k, v, *, scale, mask=None, sinks=None, **kwargs):
    plan = _plan()
    if plan is not None and sinks is None and not kwargs:
        if plan.takes(q.shape[0], q.shape[1], q.shape[2], k.shape[2]):
            return explicit_attention(q, k, v, scale, mask, plan.softmax)
    if sinks is not None:
        kwargs["sinks"] = sinks
    return _fast_sdpa(q, k, v, scale=scale, mask=mask, **kwargs)


@contextlib.contextmanager
def chunk_attention(plan: AttentionPlan) -> Iterator[None]:
    """Within the block, on this thread, the attentions ``plan`` takes
    (:meth:`AttentionPlan.takes`) run as :func:`explicit_attention`; a plan that takes
    none changes nothing."""
    if plan.max_query < plan.min_query:
        yield
        return
    if mx.fast.scaled_dot_product_attention is not _sdpa:
        mx.fast.scaled_dot_product_attention = _sdpa  # installed once; a no-op elsewhere
    before = _plan()
    _local.plan = plan
    try:
        yield
    finally:
        _local.plan = before
