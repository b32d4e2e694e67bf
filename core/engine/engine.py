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
import gc
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

from ...config.settings import Settings
from ..api import (
    CacheStats,
    EventCallback,
    Failed,
    GenerateRequest,
    ModelInfo,
    ModelLoaded,
    ModelLoading,
    RequestHandle,
    WritesFlushed,
)
from ..cache.prefix import PrefixCache
from ..device import device_info, use_cuda_graphs, use_deterministic_kernels
from ..memory import pressure as memory_mod
from . import distributed as dist
from . import ranks as ranks_mod
from .actions import ClearTier, Close, Load
from .attention import plan_attention
from .executor import Executor
from .runtime import Runtime, build_runtime, check_kv_groups

_STOP = object()
_BUSY_HOLD = "requests held"  # the engine's key among the SSD writer's holders
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

    def __init__(
        self,
        settings: Settings,
        on_log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.settings = settings
        if settings.bitwise:  # reproducible decode on CUDA too (core/device.py)
            use_deterministic_kernels()
        use_cuda_graphs(settings.cuda_graphs)
        self._on_log = on_log or (lambda text: None)
        self._jobs: queue.Queue = queue.Queue()
        self._control: queue.Queue = queue.Queue()
        self._release_queued = threading.Event()
        # the load or request being sent to the ranks (the rank watchdog fails it)
        self._handle: RequestHandle | None = None
        self._backlog: deque = deque()  # jobs taken from the queue, not yet run
        busy_writes = settings.ssd_write_while_busy
        if busy_writes is None:
            busy_writes = device_info().backend != "cuda"
        self._write_while_busy = busy_writes
        self._writes_held = False  # the engine holds the SSD writer (:meth:`_hold_writes`)
        self._busy_at = time.monotonic()  # the last moment a request was held or waiting
        self._saves_at_clear = 0  # the SSD tier's files written at the last buffer clear
        self._saves_at_release = 0  # ... when the writer was last let go (no request held)
        self._clear_when_idle = False  # a clear of host buffers waits for no request held
        self._close_timeout_s = 60.0  # the SSD writer's bound at close (:meth:`shutdown`)
        self.monitor = memory_mod.MemoryMonitor(
            limit_bytes=settings.memory_limit,
            soft_fraction=settings.memory_soft_fraction,
            hard_fraction=settings.memory_hard_fraction,
        )
        # the requests held and the actions that move them (docs/DESIGN.md §20); those
        # that arrive while a step runs can start within it (:meth:`_admit_arrived`);
        # ``clock`` times forwards for the scheduler's budget (tests pass a still one)
        self.executor = Executor(
            settings, self.monitor, self.release_host_buffers, self._admit_arrived, clock
        )
        self._thread = threading.Thread(target=self._run, name="tierchat-engine", daemon=True)
        self._thread.start()
        _live_engines.add(self)

    # ------------------------------------------------------------------ public API
    @property
    def runtime(self) -> Runtime | None:
        """The loaded model and what was built from it (None: none loaded), swapped as
        one reference by a load (docs/DESIGN.md §2)."""
        return self.executor.runtime

    @runtime.setter
    def runtime(self, runtime: Runtime | None) -> None:
        self.executor.runtime = runtime

    @property
    def peers(self) -> ranks_mod.Peers:
        """This engine's ranks (docs/DESIGN.md §19): one process alone until the first
        load joins a group it was launched in."""
        return self.executor.peers

    @peers.setter
    def peers(self, peers: ranks_mod.Peers) -> None:
        self.executor.peers = peers

    @property
    def record_logprobs(self) -> int:
        """Tests: keep the first N steps' logprob vectors in each request's trace."""
        return self.executor.record_logprobs

    @record_logprobs.setter
    def record_logprobs(self, n: int) -> None:
        self.executor.record_logprobs = n

    @property
    def loaded(self) -> Any:
        """The loaded model (:class:`~.models.loading.LoadedModel`), or None."""
        return self.runtime.loaded if self.runtime is not None else None

    @property
    def cache(self) -> PrefixCache | None:
        """The prefix cache of the loaded model, or None (none loaded, or caching off)."""
        return self.runtime.cache if self.runtime is not None else None

    @property
    def model_name(self) -> str:
        return self.runtime.spec if self.runtime is not None else ""

    @property
    def supported(self) -> bool | None:
        """Whether the loaded model's caches can be cached (None: no model loaded)."""
        return self.runtime.supported if self.runtime is not None else None

    @property
    def reason(self) -> str:
        return self.runtime.reason if self.runtime is not None else ""

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return self.runtime.layer_kinds if self.runtime is not None else ()

    @property
    def tokenizer(self):
        return self.loaded.tokenizer if self.loaded is not None else None

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.loaded.eos_token_ids) if self.loaded is not None else set()

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
        self._jobs.put((self.load_here, model, handle))
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

    @property
    def writes_queued(self) -> int:
        """Entries the SSD writer has accepted and not yet written (0 without a cache)."""
        return self.cache.writes_queued if self.cache is not None else 0

    def shutdown(self, timeout_s: float, *, close: bool = True) -> WritesFlushed:
        """Stop within about ``timeout_s`` seconds (a server's SIGTERM, docs/DESIGN.md
        §15): the SSD writer gets the bound to write its queue
        (:meth:`PrefixCache.flush <.cache.prefix.PrefixCache.flush>`), what the engine
        still stores as it closes gets what is left of it (at least 0.5 s), then
        :meth:`close` unless ``close`` is False (the ranks failed: the engine thread may
        be blocked in a collective). Any thread but the engine's."""
        deadline = time.monotonic() + timeout_s
        cache = self.cache
        if cache is None:
            if close:
                self.close()
            return WritesFlushed()
        written, dropped = cache.ssd_files_written, cache.ssd_write_drops
        queued = cache.writes_queued
        cache.flush(max(0.0, deadline - time.monotonic()))
        if close:
            self._close_timeout_s = max(0.5, deadline - time.monotonic())
            self.close()
        return WritesFlushed(
            queued, cache.ssd_files_written - written, cache.ssd_write_drops - dropped
        )

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
                last_turn=self.executor.last,
                ranks=self.peers.stats,
                requests=self.executor.states(),
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
            last_turn=self.executor.last,
            events=tuple(cache.events),
            ranks=self.peers.stats,
            requests=self.executor.states(),
        )

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        """The job loop. Requests go to the scheduler, which steps while it holds any;
        other jobs (a load, :meth:`call`, the stop) wait for it to empty, in order, and
        the jobs behind them wait too (docs/DESIGN.md §20)."""
        backlog = self._backlog
        while True:
            sched = self.executor
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
            if sched.busy or backlog or not self._jobs.empty():
                self._busy_at = time.monotonic()
            elif self.cache is not None:  # deferred entries past their window go to the writer
                self.cache.write_due(time.monotonic() - self._busy_at)

    def _take_jobs(self, block: bool) -> None:
        """Move the jobs queued now to the backlog (``block``: wait for one first, or
        until a deferred SSD entry is due: docs/DESIGN.md §8.6)."""
        quiet_for = time.monotonic() - self._busy_at
        wait = self.cache.write_due_in(quiet_for) if block and self.cache is not None else None
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
        uid, self._handle = self.executor.next_uid, handle  # the watchdog fails it if need be
        try:  # across ranks the workers queue it too, with the same uid
            self.peers.share_request(req, uid)
        except dist.RankError as exc:
            handle.emit(Failed(str(exc), kind="error"))
            return
        self.executor.admit(req, handle, uid)

    def _stop(self) -> None:
        try:
            self.peers.send(Close())
        except dist.RankError as exc:
            self._on_log(str(exc))
        if self.cache is not None:
            self.cache.close(self._close_timeout_s)
            self.cache.release_ram()  # the RAM tiers' arrays go now
        # free the weights now, and MLX's buffer cache with them, so a restart in
        # the same process (replay, the bench) never holds two models' memory at
        # once (the folded schedule's head closure holds the trunk's weights too)
        if self.runtime is not None:
            self.runtime = self.runtime.unloaded()
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
                self.peers.send(ClearTier(tier))
                if self.cache is not None or self.peers.size > 1:
                    box.append(self.clear_here(tier))
            except Exception as exc:
                box.append(exc)
            finally:
                done.set()

    # ------------------------------------------------------------------ ranks
    def join_peers(self) -> ranks_mod.Peers:
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
        for handle in [self._handle, *self.executor.handles()]:
            if handle is not None and not handle.done:
                handle.emit(Failed(message, kind="error"))

    def clear_here(self, tier: str) -> str:
        """Clear ``tier`` of this rank's cache (rank 0 sent the same to every worker); on
        the engine thread. Returns the report."""
        msg = self.cache.clear(tier) if self.cache is not None else f"cleared {tier}: no cache"
        self.peers.gather_stats(self.cache, self.monitor.stats)
        return self.peers.on_every_rank(msg)

    def close_model(self) -> None:
        """A worker's side of rank 0's engine closing: flush and drop the model; on the
        engine thread."""
        if self.cache is not None:
            self.cache.close()
        self.runtime = None
        self.peers.forget_restore()

    # ------------------------------------------------------------------ load
    def load_here(self, spec: str, handle: RequestHandle) -> None:
        """Load ``spec`` now, on the engine thread (a worker rank's loop; others queue it
        with :meth:`load_model`): its events go to ``handle``."""
        from ..models.loading import load_model

        def progress(done: int, total: int, message: str = "") -> None:
            handle.emit(ModelLoading(spec, done, total, message))

        s = self.settings
        self._handle = handle
        # the softmax keys the cache's entries: its first probe is kept with the cache
        choice = None if s.no_cache else Path(s.cache_dir) / "softmax.json"
        attention = plan_attention(s.chunk_attention, choice_file=choice)
        try:
            peers = self.join_peers()
            peers.send(Load(spec))

            def load():
                loaded = load_model(
                    spec, models_dir=Path(s.models_dir), progress=progress, group=peers.group
                )
                check_kv_groups(loaded.model, s)
                return loaded

            loaded = peers.agree_loaded(load)
        except Exception as exc:  # the current model and its cache stay as they were
            handle.emit(Failed(str(exc), kind="load"))
            return
        old, self.runtime = self.runtime, None
        if old is not None and old.cache is not None:
            old.cache.close()
        del old
        runtime, warning = build_runtime(
            spec, loaded, s, attention, self.peers, self.release_host_buffers
        )
        self.runtime = runtime
        if runtime.supported:
            self.peers.gather_stats(runtime.cache, self.monitor.stats)
        handle.emit(ModelLoaded(spec, warning=warning))

    # ------------------------------------------------------------------ generate
    @property
    def info(self) -> ModelInfo | None:
        """The loaded model's :class:`~tierchat.core.api.ModelInfo`, or None (no model)."""
        return self.runtime.info if self.loaded is not None else None

    @property
    def context_length(self) -> int | None:
        """The model's context length in tokens, from its config, or None if unknown."""
        info = self.info
        return info.context_length if info is not None else None
