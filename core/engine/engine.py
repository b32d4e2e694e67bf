"""The engine: one long-lived thread that does every MLX operation.

MLX streams belong to the thread that made them (mlx >= 0.31), so loading, prefill,
decode and every cache slice, snapshot and restore happen on the engine thread. Other
threads send jobs through a queue and get events back (docs/DESIGN.md §2).

A generation: restore the longest allowed cached prefix (the resident cache of the last
request cut back in place, or entries from the hot and SSD tiers), prefill the rest in the
prompt's schedule of chunks (:func:`~.cache.prefix.schedule_points`: multiples of
``prefill_chunk``, message ends, N-1) with one eval per chunk that also materializes the
blocks and checkpoints captured from it, then decode from the last prompt token with
mlx-lm's ``generate_step``, store the prompt + reply and keep that cache resident. A cold
run (``use_cache=False``) computes the same chunks, so a restore at a schedule point gives
the cold run's tokens bit for bit.

The same prompt again (regenerate, or a retry) is the one case with no new token: the
resident cache is cut back to the whole prompt and the first token is sampled from the
logprobs kept from the request before (the output of the same forward a cold run makes),
so its TTFT has no forward at all (:meth:`~.cache.prefix.PrefixCache.restore_repeat`).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import hashlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

from ...config.settings import Settings
from ..api import (
    CacheStats,
    EventCallback,
    Failed,
    Finished,
    GenerateRequest,
    ModelLoaded,
    ModelLoading,
    PrefillProgress,
    RankStats,
    RequestHandle,
    TokenBatch,
    TurnMetrics,
)
from ..cache import layers as L
from ..cache.blocks import LOGPROBS
from ..cache.prefix import PrefixCache, chunk_ends, probe_specs, schedule_points
from ..cache.rates import Rates
from ..cache.request import CacheRequest, ColdRequest
from ..memory import prefill as prefill_mod
from ..memory import pressure as memory_mod
from . import distributed as dist
from .attention import OFF, chunk_attention, mlx_softmax, plan_attention, pow_softmax
from .device import device_info, use_deterministic_kernels
from .forward import last_logits_fn, logprobs_of, verify_last_logits
from .ranks import RankSeams
from .sampling import RequestSampling, StopStrings, keep_last_logits, make_request_sampler

_STOP = object()
# the CPU's limit on a folded last chunk, per layer (docs/DESIGN.md §7): a 1-token forward of
# demo (24 layers, float32) costs about what 20 tokens' share of a prefill does, and the
# folded chunk's extra work is one layer of its tokens
FOLD_TOKENS_PER_LAYER = 20
_live_engines: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _clear_main_thread_streams() -> None:
    mx.clear_streams()


@atexit.register
def _close_live_engines() -> None:
    # runs before the handler above (atexit is last in, first out)
    for engine in list(_live_engines):
        engine.close()


def _from_kept(logprobs: mx.array, model, caches, max_tokens: int, sampler, logits_processors=None):
    """What ``generate_step`` yields for a prompt whose every token is in ``caches``, given
    the logprobs (shape ``(vocab,)``) its last token's forward gave before: the first
    token sampled from them, then ``generate_step`` from that token. The sampler is called
    in the same order as in ``generate_step``, so a seeded sampler draws the same."""
    y = sampler(logprobs[None])
    yield y.item(), logprobs
    if max_tokens > 1:
        yield from generate_step(
            y,
            model,
            prompt_cache=caches,
            max_tokens=max_tokens - 1,
            sampler=sampler,
            logits_processors=logits_processors,
        )


class Engine(RankSeams):
    """Owns the model, the prefix cache and the MLX thread.

    Construct with the :class:`~tierchat.config.settings.Settings` in force, then
    ``load_model(spec).wait()``; ``submit`` generations; ``stats`` and ``clear`` at will;
    ``close`` at the end (flushes the SSD writer). Its rank seams (docs/DESIGN.md §19) are
    :class:`~.engine_ranks.RankSeams`.
    """

    def __init__(self, settings: Settings, on_log: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        if settings.bitwise:  # reproducible decode on CUDA too (core/engine/device.py)
            use_deterministic_kernels()
        self.model_name = ""
        self.loaded = None
        self.cache: PrefixCache | None = None
        self.supported: bool | None = None
        self.reason = ""
        self.layer_kinds: tuple[str, ...] = ()
        self.record_logprobs = 0  # tests: keep the first N logprob vectors on the handle
        self._on_log = on_log or (lambda text: None)
        self._jobs: queue.Queue = queue.Queue()
        self._control: queue.Queue = queue.Queue()
        self._last = TurnMetrics()
        self._kv_profile = None
        self._release_queued = threading.Event()
        # several ranks (docs/DESIGN.md §19): set on the engine thread by the first load
        self.ranks: dist.Ranks | None = None
        self.rank_stats: tuple[RankStats, ...] = ()
        self._in_request = False
        self._handle: RequestHandle | None = None
        self._restored_by: dict[str, int] = {}
        self._attention = OFF  # which attentions run in plain MLX ops (core/engine/attention.py)
        self._last_logits = None  # set when this model's prompts use the folded schedule
        self._fold_limit: int | None = None  # longest folded last chunk (None: any)
        self.monitor = memory_mod.MemoryMonitor(
            limit_bytes=settings.memory_limit,
            soft_fraction=settings.memory_soft_fraction,
            hard_fraction=settings.memory_hard_fraction,
        )
        self._thread = threading.Thread(target=self._run, name="tierchat-engine", daemon=True)
        self._thread.start()
        _live_engines.add(self)

    # ------------------------------------------------------------------ public API
    @property
    def tokenizer(self):
        return self.loaded.tokenizer if self.loaded else None

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.loaded.eos_token_ids) if self.loaded else set()

    def submit(
        self, request: GenerateRequest, on_event: EventCallback | None = None
    ) -> RequestHandle:
        handle = RequestHandle(on_event)
        if self.ranks is not None and self.ranks.failed:
            handle.emit(Failed(self.ranks.failed, kind="error"))
            return handle
        self._jobs.put((self._generate, request, handle))
        return handle

    def load_model(self, model: str, on_event: EventCallback | None = None) -> RequestHandle:
        handle = RequestHandle(on_event)
        self._jobs.put((self._load, model, handle))
        return handle

    def clear(self, tier: str) -> None:
        """Clear a cache tier. Runs on the engine thread (between decode steps if busy)."""
        done = threading.Event()
        box: list = []
        self._control.put((tier, done, box))
        self._jobs.put((self._drain_control, None, None))
        deadline = time.monotonic() + 60
        while not done.wait(0.25) and time.monotonic() < deadline:
            if self.ranks is not None and self.ranks.failed:
                raise dist.RankError(self.ranks.failed)
        if box and isinstance(box[0], Exception):
            raise box[0]

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn()`` on the engine thread, after the jobs queued before it, and return
        what it returns (or raise what it raised). For MLX work that must not run beside
        the engine's: ``tierchat bench`` runs mlx-lm's baseline this way (docs/DESIGN.md §2).

        Raises:
            TimeoutError: ``fn`` did not finish within ``timeout`` seconds.
        """
        done = threading.Event()
        box: list = []

        def job(_arg=None, _handle=None) -> None:
            try:
                box.append((True, fn()))
            except Exception as exc:
                box.append((False, exc))
            finally:
                done.set()

        self._jobs.put((job, None, None))
        if not done.wait(timeout):
            raise TimeoutError("engine call did not finish in time")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            # a thread blocked in a collective with a rank that stopped answering never
            # takes the job: do not wait for it
            if self.ranks is None or not self.ranks.failed:
                self._thread.join(timeout=60)

    def note(self, text: str) -> None:
        """Add ``text`` to the cache events (a verify report, core/chat/verify.py); any thread
        (one append to a bounded deque)."""
        if self.cache is not None:
            self.cache.log(text)

    def stats(self) -> CacheStats:
        """One immutable snapshot; safe to call from any thread."""
        mem = self.monitor.stats()
        cache = self.cache
        if cache is None:
            return CacheStats(
                model=self.model_name,
                block_size=self.settings.block_size,
                enabled=False,
                supported=self.supported,
                reason=self.reason,
                layer_kinds=self.layer_kinds,
                memory=mem,
                last_turn=self._last,
                ranks=self.rank_stats,
            )
        hot, ssd, tails, snaps, resident = cache.tier_stats()
        return CacheStats(
            model=self.model_name,
            block_size=cache.block_size,
            enabled=True,
            supported=True,
            reason="",
            layer_kinds=self.layer_kinds,
            hot=hot,
            ssd=ssd,
            wear=cache.wear_stats(),
            tails=tails,
            snapshots=snaps,
            resident=resident,
            lookups=cache.lookup_stats(),
            memory=mem,
            last_turn=self._last,
            events=tuple(cache.events),
            ranks=self.rank_stats,
        )

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                try:
                    self._send_to_ranks({"op": "close"})
                except dist.RankError as exc:
                    self._on_log(str(exc))
                if self.cache is not None:
                    self.cache.close()
                    # the RAM tiers' arrays go now (the SSD tier's index stays readable)
                    self.cache.hot.clear()
                    self.cache.drop_resident()
                # free the weights now, and MLX's buffer cache with them, so a restart in
                # the same process (replay, the bench) never holds two models' memory at
                # once (the folded schedule's head closure holds the trunk's weights too)
                self.loaded, self._last_logits = None, None
                gc.collect()
                mx.clear_cache()
                # MLX wants each thread to destroy its own streams before it ends, or the
                # process may abort at exit (mlx >= 0.32: mx.clear_streams)
                mx.synchronize(generation_stream)
                mx.clear_streams()
                return
            fn, arg, handle = job
            try:
                fn(arg, handle)
            except Exception as exc:  # an engine error never kills the thread
                self._on_log(f"engine error: {exc!r}")
                if self.ranks is not None and not self.ranks.failed:
                    # the other ranks may be anywhere in this job now: out of step
                    self.ranks.failed = f"the ranks are out of step after {exc!r}"
                if handle is not None and not handle.done:
                    handle.emit(Failed(f"{type(exc).__name__}: {exc}"))

    def release_host_buffers(self) -> None:
        """Queue one clear of MLX's buffer cache on the engine thread, after the jobs
        queued before it (any thread; at most one waits at a time).

        On CUDA, MLX moves any buffer the host reads or fills to managed memory and
        keeps it so (``allocator::Buffer::raw_ptr``, ``allocator::malloc`` without a
        stream); once freed, its buffer cache hands such buffers to later GPU kernels by
        size alone, and they fault pages over the bus. The SSD tier's writer (host reads
        of its copies) and SSD restores (arrays filled from file bytes) free such buffers:
        the writer calls this when its queue empties, the engine after a request that
        read from SSD. Between requests, so no TTFT pays for it."""
        if not self._release_queued.is_set():
            self._release_queued.set()
            self._jobs.put((self._clear_buffer_cache, None, None))

    def _clear_buffer_cache(self, _arg=None, _handle=None) -> None:
        self._release_queued.clear()
        mx.clear_cache()

    def _drain_control(self, _arg=None, _handle=None) -> None:
        if self._in_request and self.ranks is not None:
            return  # the workers are in the request: clear between requests, on all ranks
        while True:
            try:
                tier, done, box = self._control.get_nowait()
            except queue.Empty:
                return
            try:
                if tier not in ("hot", "ssd", "tails", "all", "resident"):
                    raise ValueError(f"unknown tier {tier!r}")
                self._send_to_ranks({"op": "clear", "tier": tier})
                if self.cache is not None or self.ranks is not None:
                    box.append(self._clear_tier(tier))
            except Exception as exc:
                box.append(exc)
            finally:
                done.set()

    # ------------------------------------------------------------------ load
    def _load(self, spec: str, handle: RequestHandle) -> None:
        from ..models.loading import load_model

        def progress(done: int, total: int, message: str = "") -> None:
            handle.emit(ModelLoading(spec, done, total, message))

        s = self.settings
        self._handle = handle
        self._attention = plan_attention(s.chunk_attention)
        try:
            ranks = self._join_ranks()
            self._send_to_ranks({"op": "load", "spec": spec})
            group = ranks.group if ranks is not None else None
            loaded = self._agree_loaded(
                lambda: load_model(
                    spec, models_dir=Path(s.models_dir), progress=progress, group=group
                )
            )
        except Exception as exc:  # the current model and its cache stay as they were
            handle.emit(Failed(str(exc), kind="load"))
            return
        if self.cache is not None:
            self.cache.close()
        self.cache, self.supported = None, None
        self.loaded, self.model_name = loaded, spec
        self._last_logits = None
        warning = None
        self._kv_profile = prefill_mod.kv_profile(loaded.model, lambda m: self._make_cache())
        caches = self._make_cache()
        try:
            leaves = L.classify(caches)
        except L.UnsupportedCache as exc:
            self.supported, self.reason = False, f"caching off for {spec}: {exc}"
            self.layer_kinds = ()
            handle.emit(ModelLoaded(spec, warning=self.reason))
            return
        self.supported, self.reason = True, ""
        self.layer_kinds = tuple(f"{lf.name}:{lf.kind}" for lf in leaves)
        # on the CPU the folded chunk's last layer computes its output for the last token
        # only (core/engine/forward.py); not across ranks, whose pipeline stages pass whole chunks
        cpu = device_info().kind == "cpu"
        splits = False  # the folded chunk's last layer runs the last token only
        if not s.bitwise and not any(lf.snapshots for lf in leaves):
            # models without recurrent state: the last chunk gives the first token (with
            # its last layer split where that checks out, else whole)
            for split in (True, False) if cpu and self.ranks is None else (False,):
                fn = last_logits_fn(loaded.model, split_last_layer=split)
                if fn is not None and verify_last_logits(loaded.model, fn, self._make_cache):
                    self._last_logits, splits = fn, split and fn.splits() > 0
                    break
        # a folded chunk that computes its last layer for every token (a prefill that ends
        # before N skips that layer's output lazily) costs more than it saves on the CPU,
        # where a forward has no fixed floor: there, unless the last layer splits, fold only
        # chunks of at most FOLD_TOKENS_PER_LAYER tokens per layer (a GPU folds every one)
        self._fold_limit = FOLD_TOKENS_PER_LAYER * len(leaves) if cpu and not splits else None
        if self.ranks is not None:
            # one schedule and one softmax on every rank (pow_is_faster is timed per process)
            pow_ = self._attention.softmax is pow_softmax
            fold, pow_ = self.ranks.all_min([int(self._last_logits is not None), int(pow_)])
            if not fold:
                self._last_logits = None
            if not pow_:
                self._attention = dataclasses.replace(self._attention, softmax=mlx_softmax)
        # probe: two tokens through a throwaway cache give every cached array's shape
        logits = loaded.model(mx.array([[0, 0]]), cache=caches)
        mx.eval([c.state for c in caches])
        spec_shapes = probe_specs(leaves, caches)
        # and the first-token logprobs a prompt tail keeps (folded schedule)
        spec_shapes[LOGPROBS] = ((logits.shape[-1],), logits.dtype)
        if not s.no_cache:
            kv = f"{loaded.fingerprint}/kv{s.kv_bits}g{s.kv_group_size}"
            if self._attention.softmax is pow_softmax:  # entries of one softmax only
                kv += "/pow-softmax"
            fingerprint = hashlib.sha256(kv.encode()).hexdigest()
            self.cache = PrefixCache(
                fingerprint=fingerprint,
                leaves=leaves,
                spec=spec_shapes,
                block_size=s.block_size,
                hot_bytes=s.hot_bytes,
                ssd_dir=Path(s.cache_dir),
                ssd_bytes=s.ssd_bytes,
                max_tails=s.tail_entries,
                max_checkpoints=s.checkpoint_entries,
                writer_queue=s.writer_queue,
                pin_system=s.pin_system,
                exact_prefix=self._last_logits is not None,
                # across ranks every rank restores: a per-rank choice would split them
                rates=Rates(Path(s.cache_dir) / f"rates-{fingerprint[:16]}.json")
                if s.choose_recompute and self.ranks is None
                else None,
                write_budget=s.ssd_write_budget,
                admission=s.ssd_admission,
            )
            if self.cache.ssd is not None and not self.cache.ssd.enabled:
                warning = self.cache.ssd.reason
            if self.cache.ssd is not None:
                self.cache.ssd.on_idle = self.release_host_buffers
                rates = self.cache.rates
                if rates is not None and rates.prefill_tps <= 0 and device_info().backend == "cuda":
                    self._calibrate_prefill()
        self._gather_rank_stats()
        handle.emit(ModelLoaded(spec, warning=warning))

    def _calibrate_prefill(self, tokens: int = 1536) -> None:
        """Measure the prefill rate once, at load, for the restore-or-recompute choice
        (:mod:`.cache.rates`): after a warm-up prefill of ``tokens`` tokens (the first
        use of each kernel compiles it), a prefill of a length no request has had yet, so
        it pays the per-shape graph builds a recompute pays. On CUDA only, where computing
        can beat reading the disk and the two prefills cost well under a second (8B
        shapes on an H100); elsewhere the rates come from requests."""
        model = self.loaded.model
        with mx.stream(generation_stream):
            for n in (tokens, tokens + 67):
                ids = mx.arange(n)[None] % 2  # ids 0 and 1 exist in every vocabulary
                t0 = time.perf_counter()
                model(ids, cache=(caches := self._make_cache()))
                mx.eval([c.state for c in caches])
                dt = time.perf_counter() - t0
        self.cache.rates.observe_prefill(tokens + 67, dt)

    def _make_cache(self) -> list[Any]:
        model = self.loaded.model
        caches = (
            model.make_cache()
            if hasattr(model, "make_cache")
            else [KVCache() for _ in model.layers]
        )
        bits = self.settings.kv_bits
        if not bits:
            return caches

        def quantize(c):
            if type(c) is KVCache:
                return QuantizedKVCache(group_size=self.settings.kv_group_size, bits=bits)
            if isinstance(c, CacheList):
                c.caches = tuple(quantize(x) for x in c.caches)
            return c

        return [quantize(c) for c in caches]

    # ------------------------------------------------------------------ generate
    def _generate(self, req: GenerateRequest, handle: RequestHandle) -> None:
        self._handle = handle  # the rank watchdog fails it if a rank stops answering
        if self.loaded is None:
            handle.emit(Failed("no model loaded", kind="error"))
            return
        if not req.prompt_ids:
            handle.emit(Failed("empty prompt"))
            return
        if handle.cancelled:  # cancelled while queued: no restore, no token
            handle.emit(Failed("cancelled before it started", kind="cancelled"))
            return
        if not self._share_request(req, handle):
            return
        n = len(req.prompt_ids)
        self._apply_memory_pressure()
        try:
            chunk = self._agreed_chunk(n)
        except prefill_mod.PrefillRefused as exc:
            handle.emit(Failed(str(exc), kind="refused"))
            if self.cache is not None:
                self.cache.log(f"refused a {n}-token prefill: over the memory limit")
            return
        fold = self._last_logits is not None
        points = schedule_points(n, chunk, req.boundaries, fold=fold)
        cache = self.cache
        sampling = make_request_sampler(req)  # the one place sampling is built (§2)
        if cache is not None and req.use_cache:
            # sampling hook: processors need the first token's logits, so such a request
            # restores at most N - 1 (the cache keeps the model's own logprobs)
            limit = n - 1 if sampling.needs_logits else None
            turn = cache.begin(req.prompt_ids, points, req.boundaries, self._make_cache, limit)
        else:
            turn = ColdRequest(self._make_cache, cache.ssd if cache is not None else None)
        self._in_request, self._handle = True, handle
        try:
            # restore, prefill, decode and capture on the one stream generate_step decodes
            # on: no cross-stream waits between them
            with (
                mx.stream(generation_stream),
                chunk_attention(self._attention),
                self._watched("a request"),
            ):
                self._generate_one(req, handle, points, chunk if fold else 0, turn, sampling)
        finally:
            self._in_request, self._handle = False, None
            turn.close()
            if turn.read_ssd:
                self.release_host_buffers()

    def _generate_one(
        self,
        req: GenerateRequest,
        handle: RequestHandle,
        points: list[int],
        fold_chunk: int,
        turn: CacheRequest | ColdRequest,
        sampling: RequestSampling,
    ) -> None:
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        prompt = list(req.prompt_ids)
        n = len(prompt)
        model = self.loaded.model
        restored = self._restore(turn, points) if self.ranks is not None else turn.restore()
        restore_s = time.perf_counter() - t0
        caches = restored.caches
        start = restored.position

        def reuse(ttft: float) -> TurnMetrics:  # what the turn reused, known at its first token
            return TurnMetrics(
                prompt_tokens=n,
                cached_tokens=start,
                cached_by=dict(restored.cached_by),
                cached_kind=dict(restored.cached_kind),
                prefill_tokens=n - start,
                ttft_s=ttft,
                prefill_tps=(n - start) / ttft if ttft > 0 else 0.0,
            )

        ends = chunk_ends(start, points, fold_chunk)
        limit = self._fold_limit
        if (
            fold_chunk
            and limit is not None
            and ends
            and ends[-1] - max([start, *ends[:-1]]) > limit
        ):
            ends[-1] = n - 1  # too long to fold here: the last token goes to decode
        handle.chunk_ends = tuple(ends)

        # prefill [start, n - 1) in the schedule's chunks, one eval per chunk (the last one
        # asynchronous, overlapping the first decode step's graph building), and the last
        # prompt token through the first decode step; on the folded schedule the last
        # chunk ends at n and gives the first token's logprobs itself (core/engine/forward.py).
        # The request object captures window slices and state snapshots per chunk,
        # before the next chunk moves them
        total = n - start
        pos = start
        if ends:  # the prefill starts: its first chunk may take long (a CPU, a long prompt)
            handle.emit(PrefillProgress(0, total, 0.0))
        first_logprobs = restored.first_logprobs if start == n else None
        first_sample = None  # the folded chunk's logprobs with the processors applied
        for end in ends:
            self._drain_control()
            if self._cancelled(handle):
                kept = turn.cancel(caches, pos)
                why = f"cancelled during prefill; kept {kept} of {n} tokens"
                handle.emit(Failed(why, kind="cancelled", kept_tokens=kept))
                return
            tokens_in = mx.array(prompt[pos:end])[None]
            computed = []
            if end == n:  # folded: this chunk gives the first token's logits
                logits = self._last_logits(tokens_in, caches)
                first_logprobs = logprobs_of(logits).squeeze(0)  # kept: pre-processor
                computed.append(first_logprobs)
                if sampling.needs_logits:
                    first_sample = sampling.first_logprobs(logits.reshape(1, -1), prompt)
                    computed.append(first_sample)
            else:
                model(tokens_in, cache=caches)
            computed += [c.state for c in caches] + turn.chunk(caches, pos, end, first_logprobs)
            if end == ends[-1]:
                # the last chunk runs on the GPU while generate_step builds the first decode
                # step behind it on the same stream (its progress event is sent at launch)
                mx.async_eval(computed)
            else:
                mx.eval(computed)
            pos = end
            dt = time.perf_counter() - t0
            handle.emit(PrefillProgress(pos - start, total, (pos - start) / dt if dt > 0 else 0.0))

        # decode from the last prompt token
        if req.temperature > 0 and req.seed is not None:
            mx.random.seed(req.seed)
        sampler = sampling.sampler
        # continue hook: the first processor remembers each decode step's raw logits, so
        # the logprobs after the reply's last token are kept with the resident cache
        keep_end, end_logits = keep_last_logits()
        eos = self.eos_token_ids
        record = self.record_logprobs
        max_tokens = self._cap_tokens(req.max_tokens, n)
        if req.teacher_ids:
            # generate_step samples one step ahead of what it yields: pad the last call
            forced = iter(req.teacher_ids)
            sampler = lambda logprobs: mx.array([next(forced, 0)])  # noqa: E731
            eos, record, max_tokens = set(), len(req.teacher_ids), len(req.teacher_ids)
        sampler, stop_flags = self._share_sampler(sampler, handle)
        detok = self.loaded.tokenizer.detokenizer
        detok.reset()
        tokens: list[int] = []
        logprobs: list[np.ndarray] = []
        ttft = t_first = None
        reason = "length"
        if first_logprobs is not None:  # kept from before, or the folded last chunk's
            processors = [keep_end, *sampling.with_context(prompt)]
            steps = _from_kept(
                first_sample if first_sample is not None else first_logprobs,
                model,
                caches,
                max_tokens,
                sampler,
                processors,
            )
        else:
            processors = [keep_end, *sampling.with_context(prompt[:-1])]
            steps = generate_step(
                mx.array(prompt[n - 1 :]),
                model,
                prompt_cache=caches,
                max_tokens=max_tokens,
                sampler=sampler,
                logits_processors=processors,
            )
        stops = StopStrings(sampling.stops)
        shown = ""  # text sent so far (held back while it may begin a stop string)
        first_lp = None
        for tok, lp in steps:
            if ttft is None:
                first_lp = lp
                t_first = time.perf_counter()
                ttft = t_first - t0
                turn.first_token(caches)
                if pos < n:  # the last prompt token went through the first decode step
                    handle.emit(PrefillProgress(total, total, total / ttft if ttft else 0.0))
                # what the turn reused and its TTFT are known now: the stats show them
                # while it decodes (the decode rate comes with the finished record below)
                self._last = reuse(ttft)
            tokens.append(tok)
            if len(logprobs) < record:
                logprobs.append(np.array(lp.astype(mx.float32)))
            if tok in eos:
                reason = "stop"
                break
            detok.add_token(tok)
            if stops.stops:
                safe, hit = stops.feed(detok.text)
                handle.emit(TokenBatch((tok,), safe[len(shown) :]))
                shown = safe
                if hit:
                    reason = "stop"
                    break
            else:
                handle.emit(TokenBatch((tok,), detok.last_segment))
            self._drain_control()
            if self._stopped(handle, stop_flags, len(tokens) - 1):
                reason = "cancelled"
                break
        if first_logprobs is not None and len(tokens) == 1:
            # generate_step computes one step ahead, so a cold run's cache also holds the
            # first token when the reply stops there: forward it here, as that step would
            for _ in generate_step(
                mx.array(tokens),
                model,
                prompt_cache=caches,
                max_tokens=0,
                sampler=sampler,
                logits_processors=[keep_end],
            ):
                pass
        # generate_step evaluates one step ahead: wait for that step, or the thread-local
        # stream still has work when the thread ends and the process aborts at exit
        mx.synchronize(generation_stream)
        detok.finalize()
        text = detok.text
        if stops.stops:
            text, _ = stops.feed(text) if reason == "stop" else (text, False)
            tail_text = text[len(shown) :]
        else:
            tail_text = detok.last_segment
        if tail_text:
            handle.emit(TokenBatch((), tail_text))
        t_end = time.perf_counter()
        # the cache holds prompt + every yielded token: store its new blocks and its end,
        # then keep it resident for the next request, with the logprobs after its last
        # token (the last decode step's forward) for a continue
        end = end_logits()
        end_lp = logprobs_of(end).reshape(-1) if end is not None and tokens else None
        if end_lp is not None:
            mx.eval(end_lp)
        turn.finish(caches, prompt + tokens, first_lp, end_lp)
        handle.logprobs = logprobs
        handle.restored_position = start
        ttft = ttft if ttft is not None else t_end - t0
        g = len(tokens)
        metrics = dataclasses.replace(
            reuse(ttft),
            generation_tokens=g,
            generation_tps=(g - 1) / (t_end - t_first) if g > 1 and t_end > t_first else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()),
            finish_reason=reason,
            restore_s=restore_s,
            restore_bytes=restored.nbytes,
            restore_choice=restored.choice.describe() if restored.choice else "",
            ssd_write_bytes=turn.ssd_write_bytes,
        )
        self._last = metrics
        self._gather_rank_stats()  # before Finished: the caller's next stats() has them
        handle.emit(Finished(tuple(tokens), text, metrics))
        self._apply_memory_pressure()

    def _cap_tokens(self, max_tokens: int, n: int) -> int:
        """``max_tokens`` capped so prompt + reply stays within the model's context length
        (``max_position_embeddings`` of its config, when known); logged when it bites."""
        ctx = self.context_length
        if ctx is None:
            return max_tokens
        room = max(1, ctx - n)
        if max_tokens > room and self.cache is not None:
            self.cache.log(f"max tokens {max_tokens} capped at {room}: context length {ctx}")
        return min(max_tokens, room)

    @property
    def context_length(self) -> int | None:
        """The model's context length in tokens, from its config, or None if unknown."""
        if self.loaded is None:
            return None
        args = getattr(self.loaded.model, "args", None)
        for key in ("max_position_embeddings", "max_seq_len", "n_ctx"):
            value = getattr(args, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    # ------------------------------------------------------------------ memory
    def _apply_memory_pressure(self) -> None:
        """Shrink the hot tier's budget at soft/hard pressure, restore it at ok."""
        cache = self.cache
        if cache is None:
            return
        configured = self.settings.hot_bytes
        budget = self.monitor.budget(configured, held_bytes=cache.hot.nbytes)
        if budget != cache.hot.max_bytes:
            evicted = cache.hot.set_budget(budget)
            level = self.monitor.level()
            cache.log(f"memory {level}: hot budget {budget:,} bytes ({evicted} evicted)")
            if memory_mod.should_clear_mlx_cache(level):
                mx.clear_cache()

    def _plan_chunk(self, n: int) -> int:
        """The prefill chunk (tokens): ``prefill_chunk``, or the largest smaller one whose
        estimated peak fits the hard limit. A function of the prompt length and the memory
        in use, never of what the cache holds, so cached and cold runs use one schedule
        unless memory is short.

        Raises:
            prefill_mod.PrefillRefused: no chunk down to 16 tokens fits.
        """
        chunk = max(1, self.settings.prefill_chunk)
        if n <= 1 or self._kv_profile is None:
            return chunk
        model = self.loaded.model
        active = int(mx.get_active_memory())

        def estimate(c: int) -> int:
            return prefill_mod.estimate_for_model(
                model,
                self._kv_profile,
                active_bytes=active,
                new_tokens=n - 1,
                context_tokens=n,
                chunk_tokens=min(c, n - 1),
            )

        chunk, _ = prefill_mod.plan_prefill(
            estimate,
            self.monitor.hard_line(),
            chunk,
            min_chunk=min(16, chunk),
            new_tokens=n - 1,
        )
        return chunk
