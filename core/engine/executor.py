"""Runs the scheduler's actions on the engine thread (docs/DESIGN.md §20).

The :class:`Executor` holds the engine's requests (:class:`~.request.Request`: queued, in
prefill, decoding) and runs each action the scheduler (:mod:`.scheduler`) decides: a
cancel, a start (the request's checks, the memory it reserves (:mod:`.memory_gate`), its
prefill plan and restore, :meth:`~.prefill_steps.Prefill.begin`), a refusal for memory
(docs/DESIGN.md §11), a prefill piece or group (:mod:`.prefill_steps`,
:mod:`.prefill_batch`), a decode step (:class:`~.decode_batch.DecodeBatch`), and what
follows from them: the first token's sampling, detokenizing and stop strings
(:class:`~.request.Decoding`), the cache's finish, the metrics and memory pressure.

A request's prefill is tierchat's own (restore, schedule chunks with their captures, the
folded last chunk that gives the first token's logprobs); then it joins the batch with
its filled cache and the token to feed next, and when it ends its cache comes back out
for its cache request's ``finish`` (the resident, hot and SSD tiers get it as a request
run alone). Across ranks (docs/DESIGN.md §19) rank 0 sends each action to the workers
before it runs it (:meth:`Executor.step`); a worker's loop runs the same actions
(:meth:`Executor.follow`), and the sampled tokens are rank 0's on every rank
(``peers.share_tokens``), so every rank's batch holds the same sequences at every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ...config.settings import Settings
from ..api import (
    Failed,
    Finished,
    GenerateRequest,
    PrefillProgress,
    RequestHandle,
    RequestState,
    TokenBatch,
    TurnMetrics,
)
from ..memory import prefill as prefill_mod
from ..memory import pressure as memory_mod
from ..memory.admission import Verdict
from ..stop_strings import StopStrings
from . import actions
from .actions import Action, Cancel, Decode, Group, Piece, Refuse, Start
from .attention import OFF, chunk_attention
from .decode_batch import DecodeBatch
from .dequantized import dequantized_matmuls
from .forward import logprobs_of
from .forward_cost import ForwardCost
from .memory_gate import MemoryGate
from .prefill_batch import prefill_group
from .prefill_steps import Prefill
from .ranks import PREFILL_FAILED, Agreed, OneProcess, Peers
from .request import Decoding, Request
from .runtime import Runtime
from .sampling import SeededSampler, keep_last_logits
from .scheduler import Scheduler


class Executor:
    """The engine's requests and the actions that move them (docs/DESIGN.md §20).

    :meth:`admit` queues a request; :meth:`step` (rank 0) asks the scheduler for a step's
    actions and runs each, sending it to the other ranks first; :meth:`follow` (a worker)
    runs one action rank 0 sent. ``runtime`` and ``peers`` are the engine's (set on load
    and when the ranks are joined); ``clock()`` times forwards for the cost model and the
    step's budget (injected: tests pass one that does not move); ``release_host_buffers``
    is called after a request that read from SSD."""

    def __init__(
        self,
        settings: Settings,
        monitor: memory_mod.MemoryMonitor,
        release_host_buffers: Callable[[], None] = lambda: None,
        arrivals: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.settings = settings
        self.monitor = monitor
        self.release_host_buffers = release_host_buffers
        self.clock = clock
        self._runtime: Runtime | None = None
        # what the requests held reserve; the tiers' budget yields to it (docs/DESIGN.md §11)
        self.memory_gate = MemoryGate(settings, monitor)
        self.peers: Peers = OneProcess()
        self.cost = ForwardCost()  # prefill forwards measured: sizes pieces and groups
        self.scheduler = Scheduler(
            settings.prefill_chunk, settings.bitwise, self.cost, clock, arrivals
        )
        self.queued: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.decoding: dict[int, Request] = {}
        self.batch: DecodeBatch | None = None
        self.record_logprobs = 0  # tests: keep the first N logprob vectors in the trace
        self.last = TurnMetrics()  # the last request's figures (at its first token, its end)
        self.peak_group = 0  # the most requests prefilled in one forward
        self._uid = 0

    # ------------------------------------------------------------------ the view
    @property
    def runtime(self) -> Runtime | None:
        return self._runtime

    @runtime.setter
    def runtime(self, runtime: Runtime | None) -> None:
        self._runtime = runtime
        self.memory_gate.runtime = runtime  # footprints were the old model's
        self.memory_gate.forget([*self._held_uids(), *(r.uid for r in self.queued)])
        self.memory_gate.clear_footprints()
        self.memory_gate.bound_writer()

    def memory(self, r: Request) -> tuple[Verdict, str]:
        """Whether queued ``r`` fits memory beside the requests held now, and a refusal's
        message (:meth:`.memory_gate.MemoryGate.verdict`)."""
        return self.memory_gate.verdict(r.uid, r.params, self._held_uids(), len(self.queued))

    def _held_uids(self) -> list[int]:
        return [*(r.uid for r in self.prefilling), *self.decoding]

    @property
    def cache(self) -> Any:
        return self.runtime.cache if self.runtime is not None else None

    @property
    def prefill_step(self) -> int:
        return self.runtime.plan.step if self.runtime is not None else 0

    @property
    def block_size(self) -> int:
        cache = self.cache
        return cache.block_size if cache is not None else self.settings.block_size

    @property
    def busy(self) -> bool:
        return bool(self.queued or self.prefilling or self.decoding)

    def states(self) -> tuple[RequestState, ...]:
        """The requests held now, oldest first (any thread: a snapshot of plain values)."""
        out = []
        for r in [*list(self.decoding.values()), *list(self.prefilling), *list(self.queued)]:
            p, d = r.prefill, r.decoding
            out.append(
                RequestState(
                    uid=r.uid,
                    state=r.shown_status,
                    prompt_tokens=len(r.params.prompt_ids),
                    prefill_done=p.done if p is not None else 0,
                    prefill_total=p.total if p is not None else 0,
                    generated=len(d.tokens) if d is not None else 0,
                )
            )
        return tuple(out)

    def handles(self) -> list[RequestHandle]:
        """The handles of the requests held now (any thread: a snapshot)."""
        held = [*list(self.queued), *list(self.prefilling), *list(self.decoding.values())]
        return [r.handle for r in held if r.handle is not None]

    @property
    def next_uid(self) -> int:
        """The uid :meth:`admit` gives the next request."""
        return self._uid + 1

    def admit(
        self, params: GenerateRequest, handle: RequestHandle | None, uid: int | None = None
    ) -> int:
        """Queue a request (it starts at a later step) as ``uid`` (a worker rank: rank 0's,
        with no handle; None: the next); returns its uid."""
        self._uid = self._uid + 1 if uid is None else uid
        self.queued.append(Request(self._uid, params, handle))
        return self._uid

    def fail_all(self, why: str) -> None:
        """End every request held (the engine closes, loads another model, or failed)."""
        for r in [*self.queued, *self.prefilling, *self.decoding.values()]:
            if r.prefill is not None:
                r.prefill.cache_request.close()
            if not r.done:
                r.emit(Failed(why, kind="error"))
        self.queued.clear()
        self.prefilling.clear()
        self.decoding.clear()
        self.batch = None

    # ------------------------------------------------------------------ steps
    def step(self) -> None:
        """One bounded step (rank 0, or alone): each action the scheduler decides is sent
        to the other ranks, then run, before the next is decided."""
        peers = self.peers
        if peers.failed:  # the ranks failed: no step can meet its peers
            self.fail_all(peers.failed)
            return
        # what ended since (cancels, failures) reserves nothing more
        self.memory_gate.forget([*self._held_uids(), *(r.uid for r in self.queued)])
        with self._on_stream(), peers.watched("a step"):
            for action in self.scheduler.step(self):
                peers.send(action)
                self.run(action)

    def follow(self, action: Action) -> None:
        """A worker rank: run rank 0's ``action`` (docs/DESIGN.md §19), so every rank's
        requests take the same steps, in the same order."""
        with self._on_stream():
            self.run(action)

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """MLX work on the generation stream, with the runtime's attention plan."""
        attention = self.runtime.attention if self.runtime is not None else OFF
        with mx.stream(generation_stream), chunk_attention(attention):
            yield

    def _prefill_matmuls(self) -> contextlib.AbstractContextManager[None]:
        """Prefill forwards' matmuls of quantized weights as the runtime plans them
        (core/engine/dequantized.py); decode steps keep the quantized kernels."""
        return dequantized_matmuls(self.runtime.dequantize_rows if self.runtime else 0)

    def run(self, action: Action) -> None:
        """Run one action on the requests held.

        Raises:
            RuntimeError: the action does not match the requests held (ranks out of step).
        """
        if isinstance(action, Cancel):
            self._reap(set(action.uids))
        elif isinstance(action, Start):
            r = next((x for x in self.queued if x.uid == action.uid), None)
            if r is None:
                raise RuntimeError(f"out of step: start of {action.uid}, not queued")
            self._start(r)
        elif isinstance(action, Refuse):
            r = next((x for x in self.queued if x.uid == action.uid), None)
            if r is None:
                raise RuntimeError(f"out of step: refusal of {action.uid}, not queued")
            self.queued.remove(r)
            r.emit(Failed(action.message, kind="refused", permanent=action.permanent))
            self.memory_gate.release(r.uid)
            if self.cache is not None:
                n = len(r.params.prompt_ids)
                self.cache.log(f"refused a {n}-token request: {action.message[:60]}")
        elif isinstance(action, Piece):
            r = self.prefilling[0]
            if r.uid != action.uid:
                raise RuntimeError(f"out of step: piece of {action.uid}, head is {r.uid}")
            with self._prefill_matmuls():
                self._prefill_piece(r, action.end)
        elif isinstance(action, Group):
            group = [r for r in self.prefilling if r.uid in action.uids]
            if len(group) != len(action.uids):
                uids = [r.uid for r in group]
                raise RuntimeError(f"out of step: a group of {action.uids}, prefilling {uids}")
            with self._prefill_matmuls():
                self._prefill_group(group, action.width)
        elif isinstance(action, Decode):
            self._decode()
        else:
            raise ValueError(f"unknown scheduler action {action!r}")

    def _reap(self, uids: set[int]) -> None:
        """End the requests ``uids`` (cancelled): queued ones at once, a prefill keeping its
        finished pieces, a decoding one stored as a finished reply."""
        for r in [x for x in self.queued if x.uid in uids]:
            self.queued.remove(r)
            r.emit(Failed("cancelled before it started", kind="cancelled"))
        for r in [x for x in self.prefilling if x.uid in uids]:
            self.prefilling.remove(r)
            p = r.prefill
            if any(self.peers.agree_ok(p.failure)):  # a rank's prefill went wrong: no store
                p.cache_request.discard()
                kept = 0
            else:
                kept = p.cancel()
            n = len(r.params.prompt_ids)
            why = f"cancelled during prefill; kept {kept} of {n} tokens"
            r.emit(Failed(why, kind="cancelled", kept_tokens=kept))
            self._after(p)
        for r in [x for x in self.decoding.values() if x.uid in uids]:
            caches = self.batch.remove(r.uid)
            self._finish(r, caches, "cancelled")

    def _start(self, r: Request) -> None:
        """Move queued ``r`` to the prefill queue: its checks, then its prefill plan and
        restore, agreed across ranks in one exchange (a restore that needs no prefill goes
        straight to decode)."""
        self.queued.remove(r)
        runtime = self.runtime
        if runtime is None or runtime.loaded is None:
            r.emit(Failed("no model loaded", kind="error"))
            return
        if not r.params.prompt_ids:
            r.emit(Failed("empty prompt"))
            return
        n = len(r.params.prompt_ids)
        s = self.settings
        line, digest = self.memory_gate.plan_line(), actions.digest(r.uid, r.params)

        def agree(open_turn: Callable[[int], Any]) -> Agreed:
            def plan() -> int:
                return runtime.plan_chunk(s, n, line)

            # r.cold: a rank's restore landed short; it starts again from no cache
            return self.peers.start(plan, open_turn, n, digest, cold=r.cold)

        # its reservation first: the tiers yield to it before its restore allocates (the
        # resident cache stays until the restore, which may take it)
        self.memory_gate.hold(r.uid, r.params)
        self.apply_memory_pressure(drop_resident=False)
        block = runtime.cache.block_size if runtime.cache is not None else s.block_size
        try:
            p = Prefill.begin(runtime, r.params, agree, r.emit, s.bitwise, block)
        except prefill_mod.PrefillRefused as exc:
            self.memory_gate.release(r.uid)
            r.emit(Failed(str(exc), kind="refused"))
            if runtime.cache is not None:
                runtime.cache.log(f"refused a {n}-token prefill: over the memory limit")
            return
        r.prefill, r.chunk_ends, r.status = p, tuple(p.ends), "prefill"
        self.apply_memory_pressure()
        if p.finished:
            self._join(r)
        else:
            self.prefilling.append(r)

    def _void(self, r: Request, failures: tuple[int, ...]) -> None:
        """Every rank: ``r``'s prefill is void (``failures``, by rank: a rank's own work
        failed, or its restore landed short; docs/DESIGN.md §19). Nothing of it is
        stored; a failure fails the request, a short restore starts it again from no
        cache."""
        p = r.prefill
        p.cache_request.discard()
        p.caches = None
        failed = [i for i, f in enumerate(failures) if f == PREFILL_FAILED]
        if not failed and not r.cold:
            p.cache_request.log("a rank restored less than agreed: the request starts again")
            r.prefill, r.status, r.cold = None, "queued", True
            self.memory_gate.release(r.uid)  # held again when it starts again
            self.queued.appendleft(r)
            return
        ranks = ", ".join(map(str, failed)) or "every"
        why = f": {p.why}" if p.failure == PREFILL_FAILED else " (see its log)"
        message = f"the prefill failed on rank {ranks}{why}; nothing of it was cached"
        self.peers.gather_stats(self.cache, self.monitor.stats)
        r.emit(Failed(message, kind="error"))
        self.memory_gate.release(r.uid)
        self._after(p)

    def _prefill_piece(self, r: Request, end: int) -> None:
        p = r.prefill
        if self.decoding:
            # the decode step in flight first: the piece's time is its own, not the
            # decode step's too (the piece's eval would wait for it anyway)
            mx.synchronize(generation_stream)
        t0 = self.clock()
        done = p.piece(end)
        self.cost.add(done, self.clock() - t0)
        if p.finished:
            self.prefilling.popleft()
            self._join(r)

    def _prefill_group(self, group: list[Request], width: int) -> None:
        if self.decoding:
            mx.synchronize(generation_stream)  # the decode step in flight first
        padded = len(group) * width
        t0 = self.clock()
        tokens = prefill_group([r.prefill for r in group], width)
        self.cost.add(padded, self.clock() - t0)
        self.peak_group = max(self.peak_group, len(group))
        if self.cache is not None:
            self.cache.log(f"prefilled {len(group)} requests in one forward ({tokens} tokens)")
        for r in group:
            self.prefilling.remove(r)
            self._join(r)

    # ------------------------------------------------------------------ decode
    def _join(self, r: Request) -> None:
        """The prefill is done: the first token (from kept or folded logprobs), then the
        request joins the batch."""
        runtime, p, req = self.runtime, r.prefill, r.params
        self.memory_gate.prefilled(r.uid)
        n = len(req.prompt_ids)
        sampling = p.sampling
        # greedy requests share one batched argmax (None); others their own sampler, a
        # seeded one on its own key stream (the draws of the request alone)
        params = req.sampling
        sampler = None if params.greedy else sampling.sampler
        if sampler is not None and params.seed is not None:
            sampler = SeededSampler(sampler, params.seed)
        # continue hook: the first processor remembers each step's raw logits, so the
        # logprobs after the reply's last token are kept with the resident cache
        keep_end, end_logits = keep_last_logits()
        processors = [keep_end, *sampling.processors]
        eos, record = runtime.eos_token_ids, self.record_logprobs
        max_tokens = self.cap_tokens(params.max_tokens, n)
        stop = [[t] for t in sorted(eos)]
        if req.teacher_ids:
            forced = iter(req.teacher_ids)
            sampler = lambda logprobs: mx.array([next(forced, 0)])  # noqa: E731
            eos, record, max_tokens, stop = set(), len(req.teacher_ids), len(req.teacher_ids), []
        kept = p.first_logprobs is not None
        lp = (p.first_sample if p.first_sample is not None else p.first_logprobs) if kept else None
        # every rank's prefill went right, before any of it is stored (docs/DESIGN.md §19)
        tok, failures = self.peers.agree_prefill(sampler or _greedy, lp, p.failure)
        if any(failures):
            self._void(r, failures)
            return
        detok = runtime.tokenizer.detokenizer
        detok.reset()
        r.decoding = Decoding(detok, StopStrings(sampling.stops), eos, record, end_logits)
        r.status = "decoding"
        caches = p.caches
        if kept:
            # the first token from the kept (or folded) logprobs, sampled as generate_step;
            # with processors, from the folded chunk's processed copy
            p.first_token()
            ends = self._emit(r, tok, lp)
            if ends or max_tokens <= 1:
                # forward it, as the step a cold run computes ahead would
                logits = runtime.model(mx.array([[tok]]), cache=caches)
                keep_end(None, logits[:, -1, :])
                mx.eval([c.state for c in caches])
                self._finish(r, caches, "stop" if ends else "length")
                return
            token, context, left = tok, list(req.prompt_ids), max_tokens - 1
        else:
            p.first_token()
            token, context, left = req.prompt_ids[-1], list(req.prompt_ids[:-1]), max_tokens
        self._batch().add(r.uid, token, caches, context, left, stop, sampler, processors)
        p.caches = None
        self.decoding[r.uid] = r

    def _batch(self) -> DecodeBatch:
        model = self.runtime.model
        if self.batch is None or self.batch.model is not model:
            # a batch decodes with the model it was made for: after a load, the first
            # reply ran the old model on the new model's caches (a concatenate error)
            self.batch = DecodeBatch(model, self.peers.share_tokens)
        return self.batch

    def _decode(self) -> None:
        for s in self.batch.step():
            r = self.decoding.get(s.uid)
            if r is None:
                continue
            ends = self._emit(r, s.token, s.logprobs)
            if s.finish is not None or ends:
                caches = s.caches if s.caches is not None else self.batch.remove(s.uid)
                self._finish(r, caches, "stop" if ends or s.finish == "stop" else "length")

    def _emit(self, r: Request, tok: int, lp: mx.array) -> bool:
        """Record token ``tok`` (sampled from ``lp``) and send its event; whether the reply
        ends here (an end-of-sequence token or a stop string)."""
        d, p = r.decoding, r.prefill
        if d.t_first is None:
            d.t_first, d.first_lp = time.perf_counter(), lp
            if p.pos < p.n:  # the last prompt token went through the first decode step
                ttft = d.t_first - p.t0
                r.emit(PrefillProgress(p.total, p.total, p.total / ttft if ttft else 0.0))
            if not r.params.measure:  # a measurement is no turn (docs/DESIGN.md §18)
                self.last = p.metrics(d.t_first - p.t0)
        event, ends = d.add(tok, lp)
        if event is not None:
            r.emit(event)
        return ends

    def _finish(self, r: Request, caches: list[Any], reason: str) -> None:
        d, p = r.decoding, r.prefill
        self.decoding.pop(r.uid, None)
        text, tail_text = d.close(reason)
        if tail_text:
            r.emit(TokenBatch((), tail_text))
        t_end = time.perf_counter()
        # with the logprobs after the reply's last token, for a continue
        end = d.end_logits()
        end_lp = logprobs_of(end).reshape(-1) if end is not None and d.tokens else None
        if end_lp is not None:
            mx.eval(end_lp)
        # its reservation goes first: the tiers take what it leaves within their budget
        self.memory_gate.release(r.uid)
        self.apply_memory_pressure(drop_resident=False)
        p.cache_request.finish(caches, list(r.params.prompt_ids) + d.tokens, d.first_lp, end_lp)
        ttft = (d.t_first or t_end) - p.t0
        g = len(d.tokens)
        metrics = dataclasses.replace(
            p.metrics(ttft),
            generation_tokens=g,
            generation_tps=(g - 1) / (t_end - d.t_first) if g > 1 and t_end > d.t_first else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()),
            finish_reason=reason,
            ssd_write_bytes=p.cache_request.ssd_write_bytes,
        )
        if not r.params.measure:
            self.last = metrics
        # before Finished: the caller's next stats() has every rank's figures
        self.peers.gather_stats(self.cache, self.monitor.stats)
        stop_sequence = d.stops.matched if reason == "stop" else None
        r.emit(Finished(tuple(d.tokens), text, metrics, r.trace(), stop_sequence))
        self._after(p)
        self.apply_memory_pressure()

    def _after(self, p: Prefill) -> None:
        p.cache_request.close()
        if p.cache_request.read_ssd:
            self.release_host_buffers()

    # ------------------------------------------------------------------ limits
    def cap_tokens(self, max_tokens: int, n: int) -> int:
        """``max_tokens`` capped so prompt + reply stays within the model's context length
        (``ModelInfo.context_length``, when known); logged when it bites."""
        ctx = self.runtime.info.context_length if self.runtime is not None else None
        if ctx is None:
            return max_tokens
        room = max(1, ctx - n)
        if max_tokens > room and self.cache is not None:
            self.cache.log(f"max tokens {max_tokens} capped at {room}: context length {ctx}")
        return min(max_tokens, room)

    def apply_memory_pressure(self, drop_resident: bool = True) -> None:
        """Shrink the hot tier's budget at soft/hard pressure, restore it at ok, and keep
        it within the room the requests' reservations leave (docs/DESIGN.md §11); the
        resident cache goes too when it does not fit, unless ``drop_resident`` is False
        (before a restore, which takes it, and at a finish, whose caches replace it: then
        it is not charged either, its bytes being the reservation's or on their way out;
        charged, a 124K-token turn on an H200 evicted the whole hot tier at each start).
        Under pressure MLX's pool of freed buffers
        goes back first (``mx.clear_cache()``): it counts as in use, and on a GPU it grows
        to tens of GB under many requests (35 GiB beside 17 GiB of live arrays with 16
        clients of an 8B model on an H100), which would otherwise empty the hot tier of
        what the next turns restore."""
        cache = self.cache
        if cache is None:
            return
        if memory_mod.should_clear_mlx_cache(self.monitor.level()):
            mx.clear_cache()
        configured, gate = self.settings.hot_bytes, self.memory_gate
        fitted = cache.fit_hot_budget(
            lambda held, leaving: gate.tier_budget(configured, held, leaving),
            drop_resident=drop_resident,
        )
        if fitted is not None:
            budget, evicted = fitted
            level = self.monitor.level()
            cache.log(f"memory {level}: hot budget {budget:,} bytes ({evicted} evicted)")


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)
