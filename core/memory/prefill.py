"""How much memory a prefill needs, and the guard that picks a chunk that fits: the KV
bytes per token of a model's cache (:func:`kv_profile`), the estimated peak of a prefill
chunk (:func:`estimate_prefill_peak`, :func:`estimate_for_model`) and :func:`plan_prefill`,
which refuses (:class:`PrefillRefused`) a prefill no chunk of which fits. Sizes in bytes,
lengths in tokens. The design: docs/DESIGN.md §11.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..units import fmt_bytes, fmt_bytes_exact

KV_STEP = 256  # tokens: mlx-lm KVCache / QuantizedKVCache / RotatingKVCache grow in steps of this
HIDDEN_COPIES = 12  # (chunk, hidden) activations alive at once: residual, norms, q, o, attn out...
KV_LAYER_COPIES = 2  # one layer's K/V copied while a cache grows (concatenate + slice update)
STATE_SCRATCH_COPIES = 8  # (h, s, s) matrices of one SSD / delta-rule step: decay, CB, product...
STATE_MIXER_COPIES = 16  # (chunk, hidden)-sized activations of a recurrent mixer (conv, gates)
STATE_STEP = 256  # tokens: mlx-lm ssm_attn processes a chunk in steps of this
SCRATCH_MARGIN = 1.10  # on all above active_bytes: fitted on CPU, tests/unit/test_memory.py
MLP_COPIES = 3  # (chunk, intermediate) activations: gate, up and their SwiGLU product
# (chunk, context) float32 score matrices of one layer alive at once: the scores, the masked
# scores and the softmax's ``s - max`` / ``power`` / normalised copies of the engine's own
# attention (core/engine/attention.py: every attention on the CPU); fitted on CPU, float32,
# to the served path (3,000-token prompts, chunks of 64-2,048 tokens: up to 2.7 copies)
SCORE_COPIES = 3


# ------------------------------------------------------------------ KV per token


@dataclass(frozen=True)
class KVProfile:
    """How a model's prompt cache grows, measured from a fresh cache's shapes (bytes).

    ``per_token``: bytes per token of the layers that grow without bound (``KVCache``,
    ``QuantizedKVCache``, unknown kinds, conservatively). ``windows``: one
    ``(bytes_per_token, max_size)`` per ``RotatingKVCache``. ``fixed``: ``ArraysCache``
    state (SSM conv + recurrent state), the same at any length.
    """

    per_token: int = 0
    windows: tuple[tuple[int, int], ...] = ()
    fixed: int = 0

    @property
    def max_per_token(self) -> int:
        """Bytes per token while no window is full: an upper bound on growth per token."""
        return self.per_token + sum(b for b, _ in self.windows)

    def nbytes(self, tokens: int, chunk_tokens: int | None = None) -> int:
        """Cache bytes after prefilling ``tokens`` tokens in chunks of ``chunk_tokens``: exact
        when the last chunk is a full one, else an upper bound (the most held during it).

        Growing layers hold ``tokens`` rounded up to :data:`KV_STEP` (mlx-lm preallocates
        256-token steps, ``KVCache.update_and_fetch``); a ``RotatingKVCache`` fed S > 1
        tokens holds up to ``max_size - 1 + S`` (``_update_concat``: "the largest size is
        self.max_size + S - 1"), ``chunk_tokens`` None meaning one chunk of ``tokens``.
        """
        if tokens <= 0:
            return 0
        s = tokens if chunk_tokens is None else min(chunk_tokens, tokens)
        window = sum(b * min(tokens, m - 1 + s) for b, m in self.windows)
        return self.per_token * _round_up(tokens, KV_STEP) + window + self.fixed


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _leaf_caches(caches: Any) -> list[Any]:
    out = []
    for c in caches:
        inner = getattr(c, "caches", None)  # CacheList
        out.extend(_leaf_caches(inner) if isinstance(inner, (list, tuple)) else [c])
    return out


def _allocated_tokens(c: Any) -> int:
    """Token slots allocated in a KV-like cache (axis 2 of its keys), 0 when empty."""
    keys = getattr(c, "keys", None)
    if isinstance(keys, (list, tuple)):  # QuantizedKVCache: (packed, scales, biases)
        keys = keys[0]
    return int(keys.shape[2]) if keys is not None else 0


def kv_profile(
    model: Any, cache_factory: Callable[[Any], list] | None = None, probe_tokens: int = 2
) -> KVProfile:
    """Measure :class:`KVProfile` by prefilling ``probe_tokens`` tokens (id 0) into a fresh
    cache from ``cache_factory(model)`` (default ``mlx_lm.models.cache.make_prompt_cache``).

    Per-token bytes come from shapes, ``nbytes / allocated slots``, not from differencing
    totals, so the 256-token preallocation does not distort them. ``ArraysCache`` (no
    ``keys``) counts as ``fixed``; a ``RotatingKVCache`` (has ``max_size``) as a window;
    anything else with ``keys`` as growing. Runs the model: call it on the engine thread.
    """
    if cache_factory is None:
        from mlx_lm.models.cache import make_prompt_cache as cache_factory
    caches = cache_factory(model)
    model(mx.zeros((1, probe_tokens), dtype=mx.int32), cache=caches)
    mx.eval([c.state for c in caches])
    per_token, windows, fixed = 0, [], 0
    for c in _leaf_caches(caches):
        nbytes = int(c.nbytes)
        slots = _allocated_tokens(c)
        if not hasattr(c, "keys") or slots == 0:
            fixed += nbytes
        elif getattr(c, "max_size", None):
            windows.append((math.ceil(nbytes / slots), int(c.max_size)))
        else:
            per_token += math.ceil(nbytes / slots)
    return KVProfile(per_token, tuple(windows), fixed)


def kv_bytes_per_token(model: Any, cache_factory: Callable[[Any], list] | None = None) -> int:
    """Bytes the prompt cache grows by per token (:attr:`KVProfile.max_per_token`): exact
    for models of ``KVCache`` layers, an upper bound while window layers are full (they stop
    growing at their window), 0 for ``ArraysCache``-only models."""
    return kv_profile(model, cache_factory).max_per_token


# ------------------------------------------------------------------ prefill estimate


def estimate_prefill_peak(
    *,
    active_bytes: int,
    new_tokens: int,
    kv_bytes_per_token: int,
    chunk_tokens: int,
    n_heads: int,
    context_tokens: int,
    vocab_size: int,
    hidden_size: int,
    dtype_bytes: int,
    intermediate_size: int | None = None,
    n_layers: int = 1,
    logits_tokens: int | None = None,
    kv_new_bytes: int | None = None,
    kv_context_bytes: int | None = None,
    extra_bytes: int = 0,
    score_copies: int = SCORE_COPIES,
) -> int:
    """Estimated peak MLX active memory (bytes) while prefilling ``new_tokens`` tokens onto
    a cache that ends up holding ``context_tokens`` (cached prefix + new tokens).

    The largest chunk is the last one: ``c = min(chunk_tokens, new_tokens)`` queries over
    ``T = context_tokens`` keys. With ``r(n)`` = n rounded up to 256 (mlx-lm ``KVCache.step``)::

        peak = active_bytes                 weights, restored caches, hot tier: as read now
             + kv_new                       kv_bytes_per_token × (r(T) - r(T - new_tokens)),
                                            or ``kv_new_bytes`` (KVProfile.nbytes: windows)
             + 1.10 × ( scores              c × T × n_heads × (3 × 4 + 1): three float32 copies
                                            (``score_copies``; 0: a fused kernel, no scores)
                                            of one layer's attention scores (scores, masked,
                                            the softmax's) + bool mask, which the engine's
                                            attention (core/engine/attention.py) and the CPU
                                            SDPA fallback materialize (Metal's fused prefill
                                            kernel does not: an upper bound there)
                      + activations         c × (12 × hidden + 3 × intermediate) × dtype_bytes:
                                            residual, norms, q/k/v/o of one chunk; gate, up
                                            and the SwiGLU product
                      + kv_copy             2 × kv_context / n_layers: one layer's K/V copied
                                            when the cache grows a step (concatenate, then the
                                            slice update), kv_context = kv_bytes_per_token ×
                                            r(T) or ``kv_context_bytes``
                      + logits )            logits_tokens × vocab_size × dtype_bytes
             + extra_bytes

    ``logits_tokens`` defaults to ``c``: mlx-lm's lm_head runs on every position of a chunk
    and ``logits[:, -1]`` does not prune it. A loop that evaluates only the cache state
    (``mx.eval([c.state for c in cache])``, as mlx-lm ``generate_step`` and our engine do)
    never computes a chunk's logits: pass 1 (the first decode step). ``intermediate_size``
    defaults to 4 × hidden. The copy counts and the 1.10 margin were fitted to
    ``mx.get_peak_memory()`` on the CPU backend, float32 (tests/unit/test_memory.py compares
    them with measured peaks: measured <= estimate).
    """
    if new_tokens <= 0:
        return active_bytes + extra_bytes
    c = min(chunk_tokens, new_tokens)
    t = max(context_tokens, new_tokens)
    if kv_new_bytes is None:
        kv_new_bytes = kv_bytes_per_token * (
            _round_up(t, KV_STEP) - _round_up(t - new_tokens, KV_STEP)
        )
    if kv_context_bytes is None:
        kv_context_bytes = kv_bytes_per_token * _round_up(t, KV_STEP)
    inter = intermediate_size if intermediate_size is not None else 4 * hidden_size
    scores = c * t * n_heads * (score_copies * 4 + 1) if score_copies else 0
    activations = c * (HIDDEN_COPIES * hidden_size + MLP_COPIES * inter) * dtype_bytes
    kv_copy = KV_LAYER_COPIES * kv_context_bytes // max(1, n_layers)
    logits = (c if logits_tokens is None else logits_tokens) * vocab_size * dtype_bytes
    scratch = SCRATCH_MARGIN * (scores + activations + kv_copy + logits)
    return int(active_bytes + kv_new_bytes + scratch + extra_bytes)


@dataclass(frozen=True)
class ModelDims:
    """What :func:`estimate_prefill_peak` needs to know about a model."""

    n_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    n_layers: int = 1
    state_heads: int = 0


def _config_fields(model: Any) -> dict[str, Any]:
    """The model's config as a dict: ``args`` or ``config`` of the model or its inner
    ``model``, with a nested ``text_config`` merged over it (Qwen3.5, Gemma 3 VLM)."""
    fields: dict[str, Any] = {}
    for owner in (model, getattr(model, "model", None)):
        for name in ("args", "config"):
            cfg = getattr(owner, name, None)
            if cfg is not None and hasattr(cfg, "__dict__") and not fields:
                fields = dict(vars(cfg))
    text = fields.get("text_config")
    if isinstance(text, dict):
        fields = {**fields, **text}
    elif text is not None and hasattr(text, "__dict__"):
        fields = {**fields, **vars(text)}
    return fields


def model_dims(model: Any) -> ModelDims:
    """Read :class:`ModelDims` from an mlx-lm model's config (see :func:`_config_fields`).

    Missing fields fall back to weights: vocab from the largest embedding-like matrix,
    heads to ``hidden // 64``; the activation dtype is that of the first floating parameter.
    ``state_heads`` is the head count of Mamba2-style SSD layers (Mamba2 ``num_heads``,
    Falcon-H1 ``mamba_n_heads``, Nemotron-H ``mamba_num_heads``), 0 for other models.
    """
    from mlx.utils import tree_flatten

    fields = _config_fields(model)
    params = tree_flatten(model.parameters())
    floats = [v for _, v in params if v.dtype in (mx.float32, mx.float16, mx.bfloat16)]
    dtype_bytes = floats[0].dtype.size if floats else 4
    hidden = int(fields.get("hidden_size") or fields.get("d_model") or 0)
    vocab = int(fields.get("vocab_size") or 0)
    if not vocab or not hidden:
        mats = [v.shape for _, v in params if v.ndim == 2]
        big = max(mats, key=lambda s: s[0], default=(0, 0))
        vocab, hidden = vocab or big[0], hidden or big[1]
    heads = int(
        fields.get("num_attention_heads") or fields.get("num_heads") or max(1, hidden // 64)
    )
    inter = int(fields.get("intermediate_size") or 4 * hidden)
    layers = getattr(model, "layers", None) or ()
    n_layers = len(layers) or int(fields.get("num_hidden_layers") or 1)
    state_heads = int(fields.get("mamba_n_heads") or fields.get("mamba_num_heads") or 0)
    if not state_heads and "num_attention_heads" not in fields:  # Mamba2: heads are SSD heads
        state_heads = int(fields.get("num_heads") or 0)
    return ModelDims(heads, hidden, inter, vocab, dtype_bytes, n_layers, state_heads)


def estimate_for_model(
    model: Any,
    profile: KVProfile,
    *,
    active_bytes: int,
    new_tokens: int,
    context_tokens: int,
    chunk_tokens: int,
    logits_tokens: int | None = None,
    extra_bytes: int = 0,
    materializes: Callable[[ModelDims, int, int], bool] | None = None,
) -> int:
    """:func:`estimate_prefill_peak` with dims from :func:`model_dims` and the KV growth
    from ``profile`` (window layers bounded by their window). ``materializes(dims, chunk,
    context)``: whether that chunk's attention holds its score matrices (None: always;
    :meth:`~..engine.attention.AttentionPlan.materializes`); when not, no score copies
    are counted.

    Models with recurrent state (``profile.fixed > 0``) add
    ``1.10 × (8 × s² × state_heads × 4 + 16 × c × hidden × dtype_bytes)`` bytes,
    ``s = min(c, 256)``: one scan step of mlx-lm's SSD (``models/ssm.py`` ``ssm_attn``
    builds several ``(h, s, s)`` float32 matrices per 256-token step) and the recurrent
    mixer's own projections of one chunk (conv, gates). Fitted to the tiny hybrids on CPU.
    """
    d = model_dims(model)
    c = min(chunk_tokens, new_tokens)
    if profile.fixed > 0 and new_tokens > 0:  # recurrent layers
        s = min(c, STATE_STEP)
        ssd = STATE_SCRATCH_COPIES * s * s * d.state_heads * 4
        mixer = STATE_MIXER_COPIES * c * d.hidden_size * d.dtype_bytes
        extra_bytes += int(SCRATCH_MARGIN * (ssd + mixer))
    start = max(0, context_tokens - new_tokens)
    kv_new = max(
        0, profile.nbytes(context_tokens, chunk_tokens) - profile.nbytes(start, chunk_tokens)
    )
    held = materializes is None or materializes(d, c, max(context_tokens, new_tokens))
    return estimate_prefill_peak(
        active_bytes=active_bytes,
        new_tokens=new_tokens,
        kv_bytes_per_token=profile.per_token,
        chunk_tokens=chunk_tokens,
        n_heads=d.n_heads if (profile.per_token or profile.windows) else 0,  # no attention
        context_tokens=context_tokens,
        vocab_size=d.vocab_size,
        hidden_size=d.hidden_size,
        dtype_bytes=d.dtype_bytes,
        intermediate_size=d.intermediate_size,
        n_layers=d.n_layers,
        logits_tokens=logits_tokens,
        kv_new_bytes=kv_new,
        kv_context_bytes=profile.nbytes(context_tokens, chunk_tokens),
        extra_bytes=extra_bytes,
        score_copies=SCORE_COPIES if held else 0,
    )


# ------------------------------------------------------------------ prefill guard


class PrefillRefused(Exception):
    """A prefill whose estimated peak would cross the memory limit, even at the smallest
    chunk. The message names the estimate, the limit and what is really over it: when the
    weights and caches already in memory cross the line, no shorter prompt helps, and the
    message says so. The numbers are in ``estimate_bytes``, ``limit_bytes``,
    ``chunk_tokens`` (the smallest chunk tried) and ``in_use_bytes`` (None: not known)."""

    def __init__(
        self,
        estimate_bytes: int,
        limit_bytes: int,
        chunk_tokens: int,
        new_tokens: int | None = None,
        in_use_bytes: int | None = None,
    ) -> None:
        self.estimate_bytes, self.limit_bytes = estimate_bytes, limit_bytes
        self.chunk_tokens, self.new_tokens = chunk_tokens, new_tokens
        if in_use_bytes is None:
            in_use_bytes = getattr(limit_bytes, "in_use_bytes", None)
        self.in_use_bytes = in_use_bytes
        what = f"{new_tokens:,} new tokens" if new_tokens is not None else "this prompt"
        ceiling_bytes = getattr(limit_bytes, "ceiling_bytes", None)
        fraction = getattr(limit_bytes, "fraction", None)
        if ceiling_bytes is not None and fraction is not None:
            line = (
                f"the memory limit line of {fmt_bytes_exact(limit_bytes)} "
                f"({fraction:.0%} of the {fmt_bytes_exact(ceiling_bytes)} limit)"
            )
        else:
            line = f"the memory limit of {fmt_bytes_exact(limit_bytes)}"
        if in_use_bytes is not None and in_use_bytes >= limit_bytes:
            text = (
                f"prompt refused: the model's weights and caches already use "
                f"{fmt_bytes(in_use_bytes)}, over {line}, before any prefill. A shorter "
                f"prompt will not help: raise --memory-limit, clear cache tiers (hot, tails) "
                f"or use a smaller model."
            )
        else:
            held = (
                f" ({fmt_bytes(in_use_bytes)} of it weights and caches already in memory)"
                if in_use_bytes is not None
                else ""
            )
            text = (
                f"prompt refused: prefilling {what} would need about "
                f"{fmt_bytes(estimate_bytes)} at peak{held} (at a {chunk_tokens}-token "
                f"chunk), over {line}. Try a shorter prompt (fewer or shorter messages), a "
                f"smaller prefill chunk / --block-size, clearing cache tiers (hot, tails) to "
                f"free memory, or a higher --memory-limit."
            )
        super().__init__(text)


def plan_prefill(
    estimate_fn: Callable[[int], int],
    limit: int,
    chunk_tokens: int,
    min_chunk: int = 32,
    *,
    block_size: int | None = None,
    new_tokens: int | None = None,
) -> tuple[int, int]:
    """Pick the largest prefill chunk whose estimated peak fits under ``limit`` (bytes).

    Tries ``chunk_tokens``, then halves it down to ``min_chunk``, skipping sizes that are
    neither a divisor nor a multiple of ``block_size`` (chunk ends must stay on block
    boundaries). ``estimate_fn(chunk) -> bytes``. Returns ``(chunk, estimate)``.

    Raises:
        PrefillRefused: no chunk fits; carries the smallest chunk's estimate.
    """
    chunk, tried = chunk_tokens, None
    while chunk >= max(1, min_chunk):
        if block_size is None or block_size % chunk == 0 or chunk % block_size == 0:
            est = estimate_fn(chunk)
            if est <= limit:
                return chunk, est
            tried = (chunk, est)
        chunk //= 2
    if tried is None:
        tried = (chunk_tokens, estimate_fn(chunk_tokens))
    raise PrefillRefused(tried[1], limit, tried[0], new_tokens)
