"""The engine: one long-lived thread that does every MLX operation.

MLX streams belong to the thread that made them (mlx >= 0.31), so loading, prefill,
decode and every cache slice, snapshot and restore happen on the engine thread. Other
threads send jobs through a queue and get events back (docs/DESIGN.md §2).

A generation: restore the longest allowed cached prefix (the resident cache of the last
request cut back in place, or entries from the hot and SSD tiers), prefill the rest in the
prompt's schedule of chunks (:func:`~.cache.schedule.schedule_points`: multiples of
``prefill_chunk``, message ends, N-1) with one eval per chunk that also materializes the
blocks and checkpoints captured from it, then decode from the last prompt token (many
requests at once in the scheduler, :mod:`.scheduler`, docs/DESIGN.md §20; across ranks
every rank's scheduler takes rank 0's steps, §19), store the prompt + reply
and keep that cache resident. A cold run (``use_cache=False``) computes the same chunks,
so a restore at a schedule point gives the cold run's tokens bit for bit.

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
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

from ...config.settings import Settings
from ..api import (
    CacheStats,
    EventCallback,
    Failed,
    GenerateRequest,
    ModelLoaded,
    ModelLoading,
    RequestHandle,
    TurnMetrics,
)
from ..cache import layers as L
from ..cache.blocks import LOGPROBS
from ..cache.layers import probe_specs
from ..cache.prefix import PrefixCache
from ..cache.rates import Rates
from ..memory import prefill as prefill_mod
from ..memory import pressure as memory_mod
from . import distributed as dist
from . import ranks as ranks_mod
from .attention import OFF, mlx_softmax, plan_attention, pow_softmax
from .device import device_info, use_cuda_graphs, use_deterministic_kernels
from .forward import last_logits_fn, verify_last_logits
from .prefill_steps import auto_prefill_step
from .scheduler import Scheduler

_STOP = object()
_BUSY_HOLD = "requests held"  # the engine's key among the SSD writer's holders
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


class Engine:
    """Owns the model, the prefix cache and the MLX thread.

    Construct with the :class:`~tierchat.config.settings.Settings` in force, then
    ``load_model(spec).wait()``; ``submit`` generations; ``stats`` and ``clear`` at will;
    ``close`` at the end (flushes the SSD writer). It meets other ranks (docs/DESIGN.md §19)
    through its :attr:`peers` (:mod:`.ranks`: one process alone, or a group of ranks).
    """

    def __init__(self, settings: Settings, on_log: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        if settings.bitwise:  # reproducible decode on CUDA too (core/engine/device.py)
            use_deterministic_kernels()
        use_cuda_graphs(settings.cuda_graphs)
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
        # several ranks (docs/DESIGN.md §19): joined on the engine thread by the first load
        self.peers: ranks_mod.Peers = ranks_mod.OneProcess()
        # the load or request being sent to the ranks (the rank watchdog fails it)
        self._handle: RequestHandle | None = None
        self._attention = OFF  # which attentions run in plain MLX ops (core/engine/attention.py)
        self._last_logits = None  # set when this model's prompts use the folded schedule
        self._fold_limit: int | None = None  # longest folded last chunk (None: any)
        self._prefill_step = 0  # chunks are cut at its multiples (tokens; 0: not cut)
        # the requests held (docs/DESIGN.md §20); those that arrive while a step runs
        # can start within it (:meth:`_admit_arrived`)
        self._sched = Scheduler(self, arrivals=self._admit_arrived)
        self._backlog: deque = deque()  # jobs taken from the queue, not yet run
        busy_writes = settings.ssd_write_while_busy
        if busy_writes is None:
            busy_writes = device_info().backend != "cuda"
        self._write_while_busy = busy_writes
        self._writes_held = False  # the engine holds the SSD writer (:meth:`_hold_writes`)
        self._saves_at_clear = 0  # the SSD tier's files written at the last buffer clear
        self._saves_at_release = 0  # ... when the writer was last let go (no request held)
        self._clear_when_idle = False  # a clear of host buffers waits for no request held
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
        if self.peers.failed:
            handle.emit(Failed(self.peers.failed, kind="error"))
            return handle
        self._jobs.put((self._admit, request, handle))
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
            if self.peers.failed:
                raise dist.RankError(self.peers.failed)
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
            if not self.peers.failed:
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
                ranks=self.peers.stats,
                requests=self._sched.states(),
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
            ranks=self.peers.stats,
            requests=self._sched.states(),
        )

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        """The job loop. Requests go to the scheduler, which steps while it holds any;
        other jobs (a load, :meth:`call`, the stop) wait for it to empty, in order, and
        the jobs behind them wait too (docs/DESIGN.md §20)."""
        backlog = self._backlog
        while True:
            sched = self._sched
            self._take_jobs(block=not backlog and not sched.busy)
            while backlog:
                job = backlog[0]
                if job is not _STOP and job[0] == self._admit:
                    backlog.popleft()
                    self._admit(job[1], job[2])
                    continue
                if job is not _STOP and job[0] == self._drain_control:
                    backlog.popleft()
                    self._run_job(job)
                    continue
                if job is not _STOP and job[0] == self._clear_buffer_cache and sched.busy:
                    # between requests, as before batching: once none is held
                    backlog.popleft()
                    self._clear_when_idle = True
                    continue
                if sched.busy:
                    break  # a barrier: the running requests end first
                backlog.popleft()
                if job is _STOP:
                    self._stop()
                    return
                self._run_job(job)
            self._hold_writes(sched.busy)
            if sched.busy:
                try:
                    sched.step()
                except Exception as exc:  # an engine error never kills the thread
                    self._on_log(f"engine error: {exc!r}")
                    self.peers.out_of_step(exc)
                    # across ranks, the group's reason (a rank was lost), as the README says
                    sched.fail_all(self.peers.failed or f"{type(exc).__name__}: {exc}")
            self._hold_writes(sched.busy)
            if self._clear_when_idle and not sched.busy and not backlog and self._jobs.empty():
                # no request held nor waiting (clients that send their next turn as a
                # reply ends would otherwise wait for the clear)
                self._clear_buffer_cache()
            if self.cache is not None and not sched.busy and not backlog and self._jobs.empty():
                self.cache.write_due()  # deferred entries past their window go to the writer

    def _take_jobs(self, block: bool) -> None:
        """Move the jobs queued now to the backlog (``block``: wait for one first, or
        until a deferred SSD entry is due: docs/DESIGN.md §8.6)."""
        wait = self.cache.write_due_in() if block and self.cache is not None else None
        try:
            while True:
                self._backlog.append(self._jobs.get(block=block, timeout=wait))
                block = False
        except queue.Empty:
            pass

    def _admit_arrived(self) -> None:
        """During a step (the scheduler calls it before each round of starts and after a
        start's restores): the requests that arrived since join the scheduler's queue, so
        they can start, and be prefilled in a group, in this step rather than the next
        one (clients whose requests come a few milliseconds apart). Only requests at the backlog's head, in
        order: any other job stays a barrier."""
        self._take_jobs(block=False)
        backlog = self._backlog
        while backlog and backlog[0] is not _STOP and backlog[0][0] == self._admit:
            job = backlog.popleft()
            self._admit(job[1], job[2])

    def _hold_writes(self, busy: bool) -> None:
        """Hold the SSD writer while any request is held, where ``ssd_write_while_busy``
        says so (auto: on CUDA; see :meth:`release_host_buffers`): its host reads of device
        memory then happen between requests, and the buffer cache is cleared after them
        before the next decode step."""
        cache = self.cache
        if cache is None or busy == self._writes_held:
            return
        if busy and not self._write_while_busy:
            if not cache.hold_writes(_BUSY_HOLD):
                return  # no SSD tier
            self._writes_held = True
            written = cache.ssd_files_written
            if written != self._saves_at_release:
                # files written while no request was held (a writer stopped mid-queue by
                # this hold): their host-read buffers leave MLX's cache before the first step
                self._clear_buffer_cache()
            elif written != self._saves_at_clear:
                # written under backpressure while requests were held: the requests ran
                # beside those buffers already; the clear waits for no request held (a
                # clear here costs the arriving requests ~60 ms on an 8B model's pool)
                self._clear_when_idle = True
        elif not busy:
            cache.release_writes(_BUSY_HOLD)
            self._writes_held = False
            self._saves_at_release = cache.ssd_files_written

    def _admit(self, req: GenerateRequest, handle: RequestHandle) -> None:
        if self.peers.failed:
            handle.emit(Failed(self.peers.failed, kind="error"))
            return
        uid, self._handle = self._sched.next_uid, handle  # the watchdog fails it if need be
        try:  # across ranks the workers queue it too, with the same uid
            self.peers.share_request(req, uid)
        except dist.RankError as exc:
            handle.emit(Failed(str(exc), kind="error"))
            return
        self._sched.admit(req, handle, uid)

    def _stop(self) -> None:
        try:
            self.peers.send({"op": "close"})
        except dist.RankError as exc:
            self._on_log(str(exc))
        if self.cache is not None:
            self.cache.close()
            self.cache.release_ram()  # the RAM tiers' arrays go now
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

    def _run_job(self, job) -> None:
        fn, arg, handle = job
        try:
            fn(arg, handle)
        except Exception as exc:  # an engine error never kills the thread
            self._on_log(f"engine error: {exc!r}")
            self.peers.out_of_step(exc)
            if handle is not None and not handle.done:
                handle.emit(Failed(self.peers.failed or f"{type(exc).__name__}: {exc}"))

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
        self._clear_when_idle = False
        self._saves_at_clear = self.cache.ssd_files_written if self.cache is not None else 0
        mx.clear_cache()

    def _drain_control(self, _arg=None, _handle=None) -> None:
        while True:
            try:
                tier, done, box = self._control.get_nowait()
            except queue.Empty:
                return
            try:
                if tier not in ("hot", "ssd", "tails", "all", "resident"):
                    raise ValueError(f"unknown tier {tier!r}")
                self.peers.send({"op": "clear", "tier": tier})
                if self.cache is not None or self.peers.size > 1:
                    box.append(self._clear_tier(tier))
            except Exception as exc:
                box.append(exc)
            finally:
                done.set()

    # ------------------------------------------------------------------ ranks
    def _join_peers(self) -> ranks_mod.Peers:
        """This process's peers: its ranks, joined on the first load when it was launched
        as one of several (docs/DESIGN.md §19), else one process alone.

        Raises:
            dist.RankError: the ranks failed before, or could not be joined.
        """
        if self.peers.size == 1:
            self.peers = ranks_mod.join(self._rank_timeout) or self.peers
        if self.peers.failed:
            raise dist.RankError(self.peers.failed)
        return self.peers

    def _rank_timeout(self, message: str) -> None:
        # the watchdog thread: the engine thread is blocked in a collective
        self._on_log(message)
        for handle in [self._handle, *self._sched.handles()]:
            if handle is not None and not handle.done:
                handle.emit(Failed(message, kind="error"))

    def _agreed_chunk(self, n: int) -> int:
        """The prefill chunk for an ``n``-token prompt (:meth:`_plan_chunk`) on every rank.

        Raises:
            prefill_mod.PrefillRefused: a rank has no chunk that fits its memory.
        """
        return self.peers.agree_chunk(lambda: self._plan_chunk(n), n)

    def _clear_tier(self, tier: str) -> str:
        """Clear ``tier`` of this rank's cache (rank 0 sent the same to every worker)."""
        msg = self.cache.clear(tier) if self.cache is not None else f"cleared {tier}: no cache"
        self.peers.gather_stats(self.cache, self.monitor.stats)
        return self.peers.on_every_rank(msg)

    def _close_model(self) -> None:
        """A worker's side of rank 0's engine closing: flush and drop the model."""
        if self.cache is not None:
            self.cache.close()
        self.cache, self.loaded, self.model_name, self.supported = None, None, "", None
        self.peers.forget_restore()

    # ------------------------------------------------------------------ load
    def _load(self, spec: str, handle: RequestHandle) -> None:
        from ..models.loading import load_model

        def progress(done: int, total: int, message: str = "") -> None:
            handle.emit(ModelLoading(spec, done, total, message))

        s = self.settings
        self._handle = handle
        # the softmax keys the cache's entries: its first probe is kept with the cache
        choice = None if s.no_cache else Path(s.cache_dir) / "softmax.json"
        self._attention = plan_attention(s.chunk_attention, choice_file=choice)
        try:
            peers = self._join_peers()
            peers.send({"op": "load", "spec": spec})
            loaded = peers.agree_loaded(
                lambda: load_model(
                    spec, models_dir=Path(s.models_dir), progress=progress, group=peers.group
                )
            )
        except Exception as exc:  # the current model and its cache stay as they were
            handle.emit(Failed(str(exc), kind="load"))
            return
        if self.cache is not None:
            self.cache.close()
        self.cache, self.supported = None, None
        self.loaded, self.model_name = loaded, spec
        step = s.prefill_step or auto_prefill_step(loaded.model, s.prefill_chunk)
        self._prefill_step = self.peers.all_min([step])[0]  # one on every rank (its shard's)
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
            for split in (True, False) if cpu and self.peers.size == 1 else (False,):
                fn = last_logits_fn(loaded.model, split_last_layer=split)
                if fn is not None and verify_last_logits(loaded.model, fn, self._make_cache):
                    self._last_logits, splits = fn, split and fn.splits() > 0
                    break
        # a folded chunk that computes its last layer for every token (a prefill that ends
        # before N skips that layer's output lazily) costs more than it saves on the CPU,
        # where a forward has no fixed floor: there, unless the last layer splits, fold only
        # chunks of at most FOLD_TOKENS_PER_LAYER tokens per layer (a GPU folds every one)
        self._fold_limit = FOLD_TOKENS_PER_LAYER * len(leaves) if cpu and not splits else None
        # one schedule and one softmax on every rank (pow_is_faster is timed per process)
        pow_ = self._attention.softmax is pow_softmax
        fold, pow_ = self.peers.all_min([int(self._last_logits is not None), int(pow_)])
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
                if s.choose_recompute and self.peers.size == 1
                else None,
                write_budget=s.ssd_write_budget,
                admission=s.ssd_admission,
                flush_idle_s=s.ssd_flush_idle_s,
                model=spec,
            )
            warning = self.cache.ssd_warning()
            self.cache.on_ssd_idle(self.release_host_buffers)
            if self.cache.needs_prefill_rate and device_info().backend == "cuda":
                self._calibrate_prefill()
        self.peers.gather_stats(self.cache, self.monitor.stats)
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
        self.cache.observe_prefill(tokens + 67, dt)

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
        """Shrink the hot tier's budget at soft/hard pressure, restore it at ok. Under
        pressure MLX's pool of freed buffers goes back first (``mx.clear_cache()``): it
        counts as in use, and on a GPU it grows to tens of GB under many requests (35 GiB
        beside 17 GiB of live arrays with 16 clients of an 8B model on an H100), which
        would otherwise empty the hot tier of what the next turns restore."""
        cache = self.cache
        if cache is None:
            return
        if memory_mod.should_clear_mlx_cache(self.monitor.level()):
            mx.clear_cache()
        configured = self.settings.hot_bytes
        fitted = cache.fit_hot_budget(lambda held: self.monitor.budget(configured, held_bytes=held))
        if fitted is not None:
            budget, evicted = fitted
            level = self.monitor.level()
            cache.log(f"memory {level}: hot budget {budget:,} bytes ({evicted} evicted)")

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
