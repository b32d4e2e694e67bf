"""What a model load leaves the engine: one :class:`Runtime`, swapped as one reference on a
model switch (docs/DESIGN.md §2).

A load builds the model (``models.loading``), then the engine's view of it: a cache factory
(``kv_bits`` applied), the prefill plan (the CPU's prefill step, the folded last chunk and
its limit, docs/DESIGN.md §7), the attention plan, the :class:`~.cache.prefix.PrefixCache`
or None, and a :class:`~tierchat.core.api.ModelInfo`. :func:`build_runtime` makes all of it
at once on the engine thread; the engine holds the result and nothing else of the load, so
a switch or a close drops every piece together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

from ...config.settings import Settings
from ..api import ModelInfo
from ..cache import layers as L
from ..cache.blocks import LOGPROBS
from ..cache.layers import probe_specs
from ..cache.prefix import PrefixCache
from ..cache.rates import Rates
from ..device import describe_device, device_info
from ..memory import admission
from ..memory import prefill as prefill_mod
from . import dequantized
from .attention import AttentionPlan, mlx_softmax, pow_softmax
from .forward import last_logits_fn, verify_last_logits

# the CPU's prefill step when the settings leave it to the engine (docs/DESIGN.md §20):
# chunks are cut at multiples of CPU_STEP_WEIGHT_BYTES / (the weights' bytes) tokens, a
# power of two from 16 to the chunk: a function of the model, so cold and cached runs cut
# alike. demo (2 GB in float32) gets 16: about a second of this 2-core machine's prefill
CPU_STEP_WEIGHT_BYTES = 1 << 35
MIN_PREFILL_STEP = 16


def auto_prefill_step(weights_bytes: int, prefill_chunk: int) -> int:
    """The prefill step (tokens) on this device when the settings leave it to the engine:
    none (0) on a GPU; on the CPU from the weights' size in bytes
    (:data:`CPU_STEP_WEIGHT_BYTES`), none when that reaches ``prefill_chunk``."""
    if device_info().kind != "cpu":
        return 0
    chunk = max(1, prefill_chunk)
    step = max(MIN_PREFILL_STEP, CPU_STEP_WEIGHT_BYTES // max(weights_bytes, 1))
    step = 1 << (step.bit_length() - 1)  # a power of two
    return 0 if step >= chunk else step


SSD_FLOOR_BYTES = 16 << 30  # the SSD tier's automatic cap is never below this
SSD_SESSION_MARGIN = 1.25  # a session's blocks plus the tails and checkpoints beside them


def auto_ssd_bytes(session_bytes: int, free_bytes: int) -> int:
    """The SSD tier's cap in bytes when ``ssd_bytes`` is auto: room for one conversation at
    the model's whole context (``session_bytes``: its K/V, :meth:`~..memory.prefill.KVProfile.nbytes`,
    times :data:`SSD_SESSION_MARGIN`), at least :data:`SSD_FLOOR_BYTES`, at most half the
    disk's ``free_bytes`` at load (never below the floor: a full disk shrinks the tier's
    cap by itself, docs/DESIGN.md §8.4). Qwen3-8B at 131,072 tokens of bf16 K/V: 24.2 GB,
    where 16 GiB kept 94% of a 124K-token session (docs/BENCHMARKS.md)."""
    want = max(SSD_FLOOR_BYTES, int(SSD_SESSION_MARGIN * session_bytes))
    return max(SSD_FLOOR_BYTES, min(want, free_bytes // 2))


def free_disk_bytes(path: Path, own: Path | None = None) -> int:
    """Free bytes of the file system that holds ``path`` (or its nearest existing parent:
    the cache folder may not exist yet), plus the bytes of the files under ``own`` (the SSD
    tier's own folder: what it holds is room it may keep; counted as taken, a restart cut
    the cap of a 17.5 GiB session's tier from 22.5 to 16 GiB and evicted 532 of its files);
    0 when it cannot be read."""
    free = 0
    for p in (path, *path.parents):
        try:
            free = shutil.disk_usage(p).free
            break
        except OSError:
            continue
    if own is not None and free:
        for folder, _, names in os.walk(own):
            for name in names:
                try:
                    free += os.lstat(os.path.join(folder, name)).st_size
                except OSError:
                    continue
    return free


# the CPU's limit on a folded last chunk, per layer (docs/DESIGN.md §7): a 1-token forward of
# demo (24 layers, float32) costs about what 20 tokens' share of a prefill does, and the
# folded chunk's extra work is one layer of its tokens
FOLD_TOKENS_PER_LAYER = 20


@dataclass(frozen=True)
class PrefillPlan:
    """How this model's prompts are prefilled (docs/DESIGN.md §7, §20): ``step`` (tokens;
    chunks are cut at its multiples, 0: not cut), ``last_logits`` (the folded last chunk's
    forward, :func:`~.forward.last_logits_fn`; None: the last token goes to decode) and
    ``fold_limit`` (the longest folded last chunk in tokens; None: any)."""

    step: int = 0
    last_logits: Callable[..., Any] | None = None
    fold_limit: int | None = None

    @property
    def folds(self) -> bool:
        return self.last_logits is not None


@dataclass(frozen=True)
class Runtime:
    """One load's model and everything built from it (docs/DESIGN.md §2).

    ``loaded``: the :class:`~.models.loading.LoadedModel`; ``make_cache()``: a fresh
    per-layer cache list (quantized when ``kv_bits`` is set); ``cache``: the prefix cache,
    or None (caching off, or the model's caches unsupported: ``supported`` False and
    ``reason`` says why); ``kv_profile``: the KV bytes per token the memory plan reads;
    ``weights_bytes``: the model's parameters, what no eviction frees (docs/DESIGN.md §11)."""

    spec: str
    loaded: Any
    make_cache: Callable[[], list[Any]]
    plan: PrefillPlan
    attention: AttentionPlan
    cache: PrefixCache | None
    info: ModelInfo
    supported: bool = True
    reason: str = ""
    layer_kinds: tuple[str, ...] = ()
    kv_profile: Any = None
    weights_bytes: int = 0
    # prefill matmuls of quantized weights of at least this many rows dequantize first
    # (core/engine/dequantized.py; 0: never); the largest weight so dequantized (bytes)
    dequantize_rows: int = 0
    dequantized_bytes: int = 0

    @property
    def model(self) -> Any:
        return self.loaded.model

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.loaded.eos_token_ids)

    def unloaded(self) -> Runtime:
        """This runtime without its model (the engine closed): the weights and the folded
        schedule's closure over them go; the cache, closed, stays readable for stats."""
        return dataclasses.replace(self, loaded=None, make_cache=_no_model, plan=PrefillPlan())

    def with_plan(self, **changes: Any) -> Runtime:
        """This runtime with its prefill plan's ``changes`` (tests shrink ``fold_limit``)."""
        return dataclasses.replace(self, plan=dataclasses.replace(self.plan, **changes))

    def plan_chunk(self, settings: Settings, n: int, hard_line: int) -> int:
        """The prefill chunk (tokens) for an ``n``-token prompt: ``prefill_chunk``, or the
        largest smaller one whose estimated peak, over the weights alone, stays under
        ``hard_line`` bytes. A function of the prompt length, the weights and the line,
        never of what the cache tiers or other requests hold (admission makes room for
        it: docs/DESIGN.md §11), so cached and cold runs use one schedule.

        Raises:
            prefill_mod.PrefillRefused: no chunk down to 16 tokens fits.
        """
        return self._plan(settings, n, hard_line)[0]

    def footprint(
        self, settings: Settings, n: int, max_tokens: int, hard_line: int
    ) -> admission.Footprint:
        """What a request of an ``n``-token prompt and ``max_tokens`` to generate may hold
        (bytes, :class:`~..memory.admission.Footprint`): its K/V at full length and its
        prefill's scratch at the chunk :meth:`plan_chunk` picks under ``hard_line``.

        Raises:
            prefill_mod.PrefillRefused: no chunk down to 16 tokens fits.
        """
        chunk, estimate = self._plan(settings, n, hard_line)
        profile = self.kv_profile
        if profile is None:
            return admission.Footprint(0, 0, chunk)
        prompt_kv = profile.nbytes(n, chunk)
        kv = max(prompt_kv, profile.nbytes(n + max(0, max_tokens), chunk))
        scratch = max(0, estimate - self.weights_bytes - prompt_kv) if estimate else 0
        return admission.Footprint(kv, scratch, chunk)

    def _plan(self, settings: Settings, n: int, hard_line: int) -> tuple[int, int]:
        """``(chunk, estimated peak)``; the estimate is 0 when none is made."""
        chunk = max(1, settings.prefill_chunk)
        if n <= 1 or self.kv_profile is None:
            return chunk, 0
        model, profile, weights = self.loaded.model, self.kv_profile, self.weights_bytes
        attention = self.attention

        def materializes(d: prefill_mod.ModelDims, c: int, t: int) -> bool:
            return attention.materializes(d.n_heads, c, t, d.dtype_bytes)

        def estimate(c: int) -> int:
            peak = prefill_mod.estimate_for_model(
                model,
                profile,
                active_bytes=weights,
                new_tokens=n - 1,
                context_tokens=n,
                chunk_tokens=min(c, n - 1),
                materializes=materializes,
            )
            # a dequantized weight beside the chunk's activations (core/engine/dequantized.py)
            dequantizes = self.dequantize_rows and min(c, n - 1) >= self.dequantize_rows
            return peak + (self.dequantized_bytes if dequantizes else 0)

        return prefill_mod.plan_prefill(
            estimate, hard_line, chunk, min_chunk=min(16, chunk), new_tokens=n - 1
        )


def _no_model() -> list[Any]:
    raise RuntimeError("no model loaded")


def cache_factory(model: Any, settings: Settings) -> Callable[[], list[Any]]:
    """``make_cache()`` for ``model``: its own ``make_cache`` (else one ``KVCache`` a
    layer), with plain KV caches quantized when ``settings.kv_bits`` is set."""
    bits, group = settings.kv_bits, settings.kv_group_size

    def quantize(c: Any) -> Any:
        if type(c) is KVCache:
            return QuantizedKVCache(group_size=group, bits=bits)
        if isinstance(c, CacheList):
            c.caches = tuple(quantize(x) for x in c.caches)
        return c

    def make() -> list[Any]:
        caches = (
            model.make_cache()
            if hasattr(model, "make_cache")
            else [KVCache() for _ in model.layers]
        )
        return [quantize(c) for c in caches] if bits else caches

    return make


def check_kv_groups(model: Any, settings: Settings) -> None:
    """With ``kv_bits`` set, check at load that every plain KV cache's key and value head
    size is a multiple of ``kv_group_size``: MLX quantizes the last axis in groups
    (``mx.quantize``: 32, 64 or 128), so another size fails at the first prefill with
    an error about shapes. Two tokens through plain caches give the sizes.

    Raises:
        ValueError: a head size is not a multiple of the group (the message names the
            sizes that would work).
    """
    bits, group = settings.kv_bits, settings.kv_group_size
    if not bits:
        return
    plain = (
        model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    )
    model(mx.array([[0, 0]]), cache=plain)
    sizes: set[int] = set()

    def visit(c: Any) -> None:
        if type(c) is KVCache and c.keys is not None:
            sizes.update((c.keys.shape[-1], c.values.shape[-1]))
        elif isinstance(c, CacheList):
            for x in c.caches:
                visit(x)

    for c in plain:
        visit(c)
    bad = sorted(n for n in sizes if n % group)
    if bad:
        fits = [g for g in (32, 64, 128) if all(n % g == 0 for n in sizes)]
        hint = "no kv_bits"
        if fits:
            hint = f"kv_group_size = {fits[0]} (config file; TIERCHAT_KV_GROUP_SIZE={fits[0]})"
        raise ValueError(
            f"kv_bits {bits} quantizes keys and values in groups of {group} values, but "
            f"this model's heads hold {', '.join(map(str, sorted(sizes)))}: use {hint}"
        )


def config_int(model: Any, keys: tuple[str, ...]) -> int | None:
    """The first positive int among ``keys`` in ``model``'s config (its ``args``), or in
    their ``text_config`` (multimodal wrappers such as Qwen3.5 keep the text model's
    there); None when none is set. The one reader of a model's config values."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    for source in (args, text):
        for key in keys:
            value = source.get(key) if isinstance(source, dict) else getattr(source, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def context_length(model: Any) -> int | None:
    """The model's context length in tokens from its config (:func:`config_int`), or None."""
    return config_int(model, ("max_position_embeddings", "max_seq_len", "n_ctx"))


def build_runtime(
    spec: str,
    loaded: Any,
    settings: Settings,
    attention: AttentionPlan,
    peers: Any,
    on_ssd_idle: Callable[[], None],
) -> tuple[Runtime, str | None]:
    """The runtime of a model just loaded on every rank (``peers``: the engine's
    :class:`~.ranks.Peers`, whose ``all_min`` makes the plan one on every rank), and the
    load's warning (the SSD tier's, or why caching is off), or None.

    The prefill step comes from the settings or the weights' size; the folded schedule is
    kept where its forward checks out against the plain one; a probe of two tokens gives
    the cached arrays' shapes; the prefix cache is built unless ``no_cache``, and on CUDA
    its prefill rate is measured once (:func:`calibrate_prefill`).
    """
    s = settings
    model = loaded.model
    make_cache = cache_factory(model, s)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    step = s.prefill_step or auto_prefill_step(weights, s.prefill_chunk)
    step = peers.all_min([step])[0]  # one on every rank (its shard's)
    kv_profile = prefill_mod.kv_profile(model, lambda m: make_cache())
    caches = make_cache()
    cpu = device_info().kind == "cpu"
    # prefill matmuls of quantized weights (core/engine/dequantized.py), decided once
    dequantize_rows = dequantized.wanted(model)
    dequantized_bytes = dequantized.bytes_of_largest(model) if dequantize_rows else 0

    def runtime(plan: PrefillPlan, cache: PrefixCache | None, vocab: int, **kw: Any) -> Runtime:
        device = "cpu" if cpu else "gpu"
        line = describe_device(getattr(loaded, "dtype", None))
        info = ModelInfo(context_length(model), vocab, device, line)
        kw.setdefault("weights_bytes", weights)
        kw.setdefault("dequantize_rows", dequantize_rows)
        kw.setdefault("dequantized_bytes", dequantized_bytes)
        return Runtime(spec, loaded, make_cache, plan, attention, cache, info, **kw)

    try:
        leaves = L.classify(caches)
    except L.UnsupportedCache as exc:
        reason = f"caching off for {spec}: {exc}"
        vocab = config_int(model, ("vocab_size",)) or 0
        rt = runtime(
            PrefillPlan(step), None, vocab, supported=False, reason=reason, kv_profile=kv_profile
        )
        return rt, reason
    layer_kinds = tuple(f"{lf.name}:{lf.kind}" for lf in leaves)
    # on the CPU the folded chunk's last layer computes its output for the last token
    # only (core/engine/forward.py); not across ranks, whose pipeline stages pass whole chunks
    last_logits, splits = None, False
    if not s.bitwise and not any(lf.snapshots for lf in leaves):
        # models without recurrent state: the last chunk gives the first token (with
        # its last layer split where that checks out, else whole)
        for split in (True, False) if cpu and peers.size == 1 else (False,):
            fn = last_logits_fn(model, split_last_layer=split)
            if fn is not None and verify_last_logits(model, fn, make_cache):
                last_logits, splits = fn, split and fn.splits() > 0
                break
    # a folded chunk that computes its last layer for every token (a prefill that ends
    # before N skips that layer's output lazily) costs more than it saves on the CPU,
    # where a forward has no fixed floor: there, unless the last layer splits, fold only
    # chunks of at most FOLD_TOKENS_PER_LAYER tokens per layer (a GPU folds every one)
    fold_limit = FOLD_TOKENS_PER_LAYER * len(leaves) if cpu and not splits else None
    # one schedule and one softmax on every rank (pow_is_faster is timed per process)
    fold, pow_ = peers.all_min(
        [int(last_logits is not None), int(attention.softmax is pow_softmax)]
    )
    if not fold:
        last_logits = None
    if not pow_:
        attention = dataclasses.replace(attention, softmax=mlx_softmax)
    plan = PrefillPlan(step, last_logits, fold_limit)
    # probe: two tokens through a throwaway cache give every cached array's shape
    logits = model(mx.array([[0, 0]]), cache=caches)
    mx.eval([c.state for c in caches])
    spec_shapes = probe_specs(leaves, caches)
    # and the first-token logprobs a prompt tail keeps (folded schedule)
    spec_shapes[LOGPROBS] = ((logits.shape[-1],), logits.dtype)
    cache, warning = None, None
    if not s.no_cache:
        kv = f"{loaded.fingerprint}/kv{s.kv_bits}g{s.kv_group_size}"
        if attention.softmax is pow_softmax:  # entries of one softmax only
            kv += "/pow-softmax"
        fingerprint = hashlib.sha256(kv.encode()).hexdigest()
        context = context_length(model) or 0
        free = free_disk_bytes(Path(s.cache_dir), PrefixCache.ssd_folder(s.cache_dir, fingerprint))
        ssd_auto = auto_ssd_bytes(kv_profile.nbytes(context), free)
        cache = PrefixCache(
            fingerprint=fingerprint,
            leaves=leaves,
            spec=spec_shapes,
            block_size=s.block_size,
            hot_bytes=s.hot_bytes,
            ssd_dir=Path(s.cache_dir),
            ssd_bytes=s.ssd_bytes if s.ssd_bytes is not None else ssd_auto,
            max_tails=s.tail_entries,
            max_checkpoints=s.checkpoint_entries,
            writer_queue=s.writer_queue,
            pin_system=s.pin_system,
            exact_prefix=last_logits is not None,
            # across ranks every rank restores: a per-rank choice would split them
            rates=Rates(Path(s.cache_dir) / f"rates-{fingerprint[:16]}.json")
            if s.choose_recompute and peers.size == 1
            else None,
            write_budget=s.ssd_write_budget,
            admission=s.ssd_admission,
            flush_idle_s=s.ssd_flush_idle_s,
            model=spec,
        )
        warning = cache.ssd_warning()
        cache.on_ssd_idle(on_ssd_idle)
        if cache.needs_prefill_rate and device_info().backend == "cuda":
            calibrate_prefill(model, make_cache, cache, dequantize_rows)
    rt = runtime(
        plan,
        cache,
        int(logits.shape[-1]),
        layer_kinds=layer_kinds,
        kv_profile=kv_profile,
    )
    return rt, warning


def calibrate_prefill(
    model: Any,
    make_cache: Callable[[], list[Any]],
    cache: PrefixCache,
    dequantize_rows: int = 0,
    tokens: int = 1536,
) -> None:
    """Measure the prefill rate once, at load, for the restore-or-recompute choice
    (:mod:`.cache.rates`): after a warm-up prefill of ``tokens`` tokens (the first use of
    each kernel compiles it), a prefill of a length no request has had yet, so it pays the
    per-shape graph builds a recompute pays. On CUDA only, where computing can beat
    reading the disk and the two prefills cost well under a second (8B shapes on an
    H100); elsewhere the rates come from requests. ``dequantize_rows``: as the
    requests' forwards run (:mod:`.dequantized`)."""
    with mx.stream(generation_stream), dequantized.dequantized_matmuls(dequantize_rows):
        for n in (tokens, tokens + 67):
            ids = mx.arange(n)[None] % 2  # ids 0 and 1 exist in every vocabulary
            t0 = time.perf_counter()
            model(ids, cache=(caches := make_cache()))
            mx.eval([c.state for c in caches])
            dt = time.perf_counter() - t0
    cache.observe_prefill(tokens + 67, dt)
