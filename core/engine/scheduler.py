"""Many requests at once on the engine thread: queued -> prefill -> decoding -> done
(docs/DESIGN.md §20).

Each :meth:`Scheduler.step` does a bounded amount of work: it ends the requests cancelled
since the last step (queued ones fail at once, a prefill keeps its finished chunks through
its cache request's ``cancel``, a decoding one leaves the batch and stores what it has),
starts queued requests (restores; one that shares a prefix a prefill in progress will
store waits for it, :meth:`Scheduler._waits`; requests that arrived during the step's last
piece or restores are admitted first, so they start in this step), runs the rests of the requests that fit one
forward together (:mod:`.prefill_batch`) or else one prefill piece of the request at the
head of the prefill queue, then one batched decode step of every running sequence
(:class:`~.decode_batch.DecodeBatch`). So a long prompt neither freezes the other streams
nor makes Stop wait longer than one piece.

A request's prefill is tierchat's own, as before batching (:mod:`.prefill_steps`): restore,
schedule chunks with their captures, the folded last chunk that gives the first token's
logprobs; then it joins the batch with its filled cache and the token to feed next, and
when it ends its cache comes back out for ``turn.finish`` (the resident, hot and SSD tiers
get it as a request run alone). Across ranks (docs/DESIGN.md §19) rank 0's scheduler decides
each action (cancels, a start, a group, a prefill piece and where it ends, a decode step) and sends
it to the workers before running it; their schedulers run the same actions
(:meth:`Scheduler.follow`), and the sampled tokens are rank 0's on every rank
(``peers.share_tokens``), so every rank's batch holds the same sequences at every step.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

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
from ..cache.blocks import common_prefix_len
from ..memory import prefill as prefill_mod
from .attention import chunk_attention
from .decode_batch import DecodeBatch, Step
from .forward import logprobs_of
from .forward_cost import ForwardCost
from .prefill_batch import groupable, prefill_group, rest
from .prefill_steps import Prefill
from .sampling import SeededSampler, StopStrings, keep_last_logits

BUSY_PIECE_S = 0.25  # the most prefill work between two decode steps while others decode
# a lone request's prefill piece on the CPU (prefill_step set) with the folded schedule:
# about this much measured work, so a Stop waits at most one piece without cutting a short
# prompt into many small forwards (each reads every weight again)
LONE_PIECE_S = 0.5
MAX_STARTS = 8  # the most requests restored in one step (each restore: ~10 ms on a GPU)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request in the scheduler: its prefill, then its decode state."""

    uid: int
    req: GenerateRequest
    handle: RequestHandle
    prefill: Prefill | None = None
    state: str = "queued"  # queued | prefill | decoding | stopping
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[np.ndarray] = dataclasses.field(default_factory=list)
    first_lp: Any = None
    t_first: float | None = None
    detok: Any = None
    eos: set[int] = dataclasses.field(default_factory=set)
    record: int = 0
    sampler: Any = None
    end_logits: Any = None  # () -> the raw logits after the last token fed (1, vocab)
    stops: StopStrings | None = None
    shown: str = ""  # text sent so far (held back while it may begin a stop string)


class Scheduler:
    """The engine's requests: :meth:`admit` from the job loop (a worker rank: from rank 0's
    messages), :meth:`step` while :attr:`busy` (a worker rank: :meth:`follow`). Uses the
    engine's model, cache, settings and peers."""

    def __init__(self, engine: Any, arrivals: Callable[[], None] | None = None) -> None:
        self.engine = engine
        # admits the requests that arrived during this step (rank 0's engine)
        self._arrivals = arrivals
        self.queued: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.decoding: dict[int, Sequence] = {}
        self.batch: DecodeBatch | None = None
        self._uid = 0
        self.cost = ForwardCost()  # prefill forwards measured: sizes pieces and groups
        self.peak_group = 0  # the most requests prefilled in one forward

    @property
    def busy(self) -> bool:
        return bool(self.queued or self.prefilling or self.decoding)

    def states(self) -> tuple[RequestState, ...]:
        """The requests held now, oldest first (any thread: a snapshot of plain values)."""
        out = []
        for seq in [*list(self.decoding.values()), *list(self.prefilling), *list(self.queued)]:
            p = seq.prefill
            state = "stopping" if seq.handle.cancelled and seq.state != "queued" else seq.state
            out.append(
                RequestState(
                    uid=seq.uid,
                    state=state,
                    prompt_tokens=len(seq.req.prompt_ids),
                    prefill_done=p.done if p is not None else 0,
                    prefill_total=p.total if p is not None else 0,
                    generated=len(seq.tokens),
                )
            )
        return tuple(out)

    @property
    def next_uid(self) -> int:
        """The uid :meth:`admit` gives the next request."""
        return self._uid + 1

    def admit(self, req: GenerateRequest, handle: RequestHandle, uid: int | None = None) -> int:
        """Queue a request (it starts at a later :meth:`step`) as ``uid`` (a worker rank:
        rank 0's; None: the next); returns its uid."""
        self._uid = self._uid + 1 if uid is None else uid
        self.queued.append(Sequence(self._uid, req, handle))
        return self._uid

    def fail_all(self, why: str) -> None:
        """End every request held (the engine closes or loads another model)."""
        for seq in [*self.queued, *self.prefilling, *self.decoding.values()]:
            if seq.prefill is not None:
                seq.prefill.turn.close()
            if not seq.handle.done:
                seq.handle.emit(Failed(why, kind="error"))
        self.queued.clear()
        self.prefilling.clear()
        self.decoding.clear()
        self.batch = None

    def handles(self) -> list[RequestHandle]:
        """The handles of the requests held now (any thread: a snapshot)."""
        held = [*list(self.queued), *list(self.prefilling), *list(self.decoding.values())]
        return [seq.handle for seq in held]

    # ------------------------------------------------------------------ one step
    def step(self) -> None:
        """One bounded step: cancels, starts (the requests that arrived during the step's
        last piece or restores admitted first), prefill pieces or groups (up to
        :data:`BUSY_PIECE_S` of them while others decode, one otherwise; restores apart),
        one batched decode step. Each action is decided here and sent to the other ranks
        before it runs (:meth:`follow`)."""
        e = self.engine
        if e.peers.failed:  # the ranks failed: no step can meet its peers
            self.fail_all(e.peers.failed)
            return
        with mx.stream(generation_stream), chunk_attention(e._attention), e.peers.watched("a step"):
            held = [*self.queued, *self.prefilling, *self.decoding.values()]
            cancelled = [seq.uid for seq in held if seq.handle.cancelled]
            if cancelled:
                self._act({"do": "cancel", "uids": cancelled})
            spent = 0.0  # prefill work this step (restores not counted: see below)
            while True:
                # who arrived during the last action starts in this step: after a piece
                # (those that waited for its prefix), and after the restores of a start,
                # so their rests can join this step's group instead of waiting a step
                for _ in range(2):
                    if self._arrivals is not None:
                        self._arrivals()
                    if not any(not self._waits(s) for s in self.queued):
                        break
                    self._act({"do": "start"})
                if not self.prefilling:
                    break
                # the step's prefill budget: restores do not use it up, or a wave of
                # arrivals would see its group cut in two by the time its restores took
                left_s = BUSY_PIECE_S - spent
                t0 = time.perf_counter()
                group = self._group(left_s)
                if len(group) > 1:
                    self._act({"do": "group", "uids": [s.uid for s in group]})
                else:
                    seq = self.prefilling[0]
                    end = self._piece_end(seq, left_s)
                    self._act({"do": "piece", "uid": seq.uid, "end": end})
                spent += time.perf_counter() - t0
                if not self.decoding or spent >= BUSY_PIECE_S:
                    break
                if any(s.handle.cancelled for s in self.prefilling):
                    break
            if self.decoding:
                self._act({"do": "decode"})

    def follow(self, action: dict) -> None:
        """A worker rank: run rank 0's scheduler ``action`` (docs/DESIGN.md §19), so every
        rank's requests take the same steps, in the same order."""
        with mx.stream(generation_stream), chunk_attention(self.engine._attention):
            self._apply(action)

    def _act(self, action: dict) -> None:
        self.engine.peers.send({"op": "step", **action})
        self._apply(action)

    def _apply(self, action: dict) -> None:
        do = action["do"]
        if do == "cancel":
            self._reap(set(action["uids"]))
        elif do == "start":
            self._start_queued()
        elif do == "piece":
            seq = self.prefilling[0]
            if seq.uid != action["uid"]:
                raise RuntimeError(f"out of step: piece of {action['uid']}, head is {seq.uid}")
            self._prefill_piece(seq, action["end"])
        elif do == "group":
            uids = action["uids"]
            group = [s for s in self.prefilling if s.uid in uids]
            if len(group) != len(uids):
                raise RuntimeError(f"out of step: a group of {uids}, prefilling {group}")
            self._prefill_group(group)
        elif do == "decode":
            self._decode()
        else:
            raise ValueError(f"unknown scheduler action {do!r}")

    def _reap(self, uids: set[int]) -> None:
        """End the requests ``uids`` (cancelled): queued ones at once, a prefill keeping its
        finished pieces, a decoding one stored as a finished reply."""
        for seq in [s for s in self.queued if s.uid in uids]:
            self.queued.remove(seq)
            seq.handle.emit(Failed("cancelled before it started", kind="cancelled"))
        for seq in [s for s in self.prefilling if s.uid in uids]:
            self.prefilling.remove(seq)
            p = seq.prefill
            kept = p.cancel()
            n = len(seq.req.prompt_ids)
            why = f"cancelled during prefill; kept {kept} of {n} tokens"
            seq.handle.emit(Failed(why, kind="cancelled", kept_tokens=kept))
            self._after(p)
        for seq in [s for s in self.decoding.values() if s.uid in uids]:
            caches = self.batch.remove(seq.uid)
            self._finish(seq, caches, "cancelled")

    def _waits(self, seq: Sequence) -> bool:
        """Whether queued ``seq`` should wait for a request in prefill that will store a
        prefix they share (at least a block more than that request restored; with state
        layers, up to one of its checkpoints), when its rest is at most twice what waiting
        saves: clients arriving together with one new system prompt compute it once, then
        restore it. A function of the requests' tokens and positions only, so every rank
        decides alike."""
        e = self.engine
        if e.cache is None or not seq.req.use_cache:
            return False
        for other in self.prefilling:
            p = other.prefill
            if not other.req.use_cache:
                continue
            reach = common_prefix_len(seq.req.prompt_ids, p.prompt)
            if e.cache.state:  # state layers restore at its checkpoints only
                reach = max((x for x in p.checkpoints if x <= reach), default=0)
            gain = reach - p.start
            if gain >= e.cache.block_size and rest(p) <= 2 * gain:
                return True
        return False

    def _start_queued(self) -> None:
        """Move queued requests to the prefill queue (checks and restore on the way; a
        restore that needs no prefill goes straight to decode): up to :data:`MAX_STARTS`,
        in order, passing over those that :meth:`_waits`."""
        e = self.engine
        started = 0
        for seq in list(self.queued):
            if started >= MAX_STARTS:
                return
            if self._waits(seq):
                continue
            self.queued.remove(seq)
            started += 1
            if e.loaded is None:
                seq.handle.emit(Failed("no model loaded", kind="error"))
                continue
            if not seq.req.prompt_ids:
                seq.handle.emit(Failed("empty prompt"))
                continue
            e._apply_memory_pressure()
            try:
                seq.prefill = Prefill.begin(e, seq.req, seq.handle)
            except prefill_mod.PrefillRefused as exc:
                seq.handle.emit(Failed(str(exc), kind="refused"))
                if e.cache is not None:
                    n = len(seq.req.prompt_ids)
                    e.cache.log(f"refused a {n}-token prefill: over the memory limit")
                continue
            seq.state = "prefill"
            if seq.prefill.finished:
                self._join(seq)
            else:
                self.prefilling.append(seq)

    def _piece_end(self, seq: Sequence, left_s: float) -> int:
        """Where the next prefill piece of ``seq`` ends: the next cut, or sooner where
        others wait and the measured cost says ``left_s`` seconds do less."""
        e = self.engine
        budget, lone = None, False
        if self.decoding or len(self.prefilling) > 1 or self.queued:
            budget = self.cost.tokens_in(max(left_s, 0.05))  # what fits the step's time left
        elif e._prefill_step and not e.settings.bitwise:
            budget = self._lone_budget()
            lone = budget is not None
        return seq.prefill.next_end(budget, lone=lone)

    def _lone_budget(self) -> int | None:
        """Tokens of about :data:`LONE_PIECE_S` of work: by the forwards measured, or a
        whole prefill's rate (kept across restarts) where that says more."""
        fitted = self.cost.tokens_in(LONE_PIECE_S) or 0
        return max(fitted, self._kept_tokens(LONE_PIECE_S)) or None

    def _kept_tokens(self, seconds: float) -> int:
        """Tokens of ``seconds`` at the cache's whole-prefill rate kept across restarts
        (0: none known)."""
        cache = self.engine.cache
        return int((cache.prefill_rate if cache is not None else 0.0) * seconds)

    def _prefill_piece(self, seq: Sequence, end: int) -> None:
        p = seq.prefill
        if self.decoding:
            # the decode step in flight first: the piece's time is its own, not the
            # decode step's too (the piece's eval would wait for it anyway)
            mx.synchronize(generation_stream)
        t0 = time.perf_counter()
        done = p.piece(end)
        self.cost.add(done, time.perf_counter() - t0)
        if p.finished:
            self.prefilling.popleft()
            self._join(seq)

    def _group(self, left_s: float) -> list[Sequence]:
        """The requests whose rests go through the model together next (:mod:`.prefill_batch`):
        in order, the groupable ones while the padded batch (rows x the longest rest) fits
        a prefill chunk and, at the measured cost (:class:`.ForwardCost`), the step's time
        left while others wait or decode, else :data:`LONE_PIECE_S` (on a CPU, where a row
        costs as much in a group as alone, rests rarely group). Fewer than two: none."""
        e = self.engine
        limit = e.settings.prefill_chunk
        # a group is one forward: at most a piece's time, so Stop waits no longer
        if self.decoding or self.queued:
            left_s = max(left_s, 0.05)
            # none measured yet: by the kept whole-prefill rate
            fits = self.cost.tokens_in(left_s) or self._kept_tokens(left_s) or None
        else:
            fits = self._lone_budget()
        if fits is not None:
            limit = min(limit, fits)
        group: list[Sequence] = []
        width = 0
        for seq in self.prefilling:
            p = seq.prefill
            if not groupable(p):
                continue
            w = max(width, rest(p))
            cap = min(limit, p.chunk)  # no row's planned chunk (its memory plan) exceeded
            if (len(group) + 1) * w > cap:
                continue
            group.append(seq)
            width, limit = w, cap
        return group if len(group) > 1 else []

    def _prefill_group(self, group: list[Sequence]) -> None:
        if self.decoding:
            mx.synchronize(generation_stream)  # the decode step in flight first
        padded = len(group) * max(rest(seq.prefill) for seq in group)
        t0 = time.perf_counter()
        tokens = prefill_group([seq.prefill for seq in group])
        self.cost.add(padded, time.perf_counter() - t0)
        self.peak_group = max(self.peak_group, len(group))
        if self.engine.cache is not None:
            self.engine.cache.log(
                f"prefilled {len(group)} requests in one forward ({tokens} tokens)"
            )
        for seq in group:
            self.prefilling.remove(seq)
            self._join(seq)

    # ------------------------------------------------------------------ decode
    def _join(self, seq: Sequence) -> None:
        """The prefill is done: the first token (from kept or folded logprobs), then the
        sequence joins the batch."""
        e, p, req = self.engine, seq.prefill, seq.req
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
        keep_end, seq.end_logits = keep_last_logits()
        processors = [keep_end, *sampling.processors]
        seq.stops = StopStrings(sampling.stops)
        seq.eos = e.eos_token_ids
        seq.record = e.record_logprobs
        max_tokens = e._cap_tokens(params.max_tokens, n)
        stop = [[t] for t in sorted(seq.eos)]
        if req.teacher_ids:
            forced = iter(req.teacher_ids)
            sampler = lambda logprobs: mx.array([next(forced, 0)])  # noqa: E731
            seq.eos, seq.record, max_tokens, stop = (
                set(),
                len(req.teacher_ids),
                len(req.teacher_ids),
                [],
            )
        seq.sampler = sampler
        seq.detok = e.loaded.tokenizer.detokenizer
        seq.detok.reset()
        seq.state = "decoding"
        caches = p.caches
        if p.first_logprobs is not None:
            # the first token from the kept (or folded) logprobs, sampled as generate_step;
            # with processors, from the folded chunk's processed copy
            lp = p.first_sample if p.first_sample is not None else p.first_logprobs
            y = e.peers.share_tokens(sampler or _greedy)(lp[None])
            tok = int(y.item())
            p.first_token()
            end = self._emit(seq, tok, lp)
            if end is not None or max_tokens <= 1:
                # forward it, as the step a cold run computes ahead would
                logits = e.loaded.model(mx.array([[tok]]), cache=caches)
                keep_end(None, logits[:, -1, :])
                mx.eval([c.state for c in caches])
                self._finish(seq, caches, end or "length")
                return
            self._batch().add(
                seq.uid,
                tok,
                caches,
                list(req.prompt_ids),
                max_tokens - 1,
                stop,
                sampler,
                processors,
            )
        else:
            last = req.prompt_ids[-1]
            p.first_token()
            self._batch().add(
                seq.uid,
                last,
                caches,
                list(req.prompt_ids[:-1]),
                max_tokens,
                stop,
                sampler,
                processors,
            )
        p.caches = None
        self.decoding[seq.uid] = seq

    def _batch(self) -> DecodeBatch:
        if self.batch is None:
            self.batch = DecodeBatch(self.engine.loaded.model, self.engine.peers.share_tokens)
        return self.batch

    def _decode(self) -> None:
        for s in self.batch.step():
            seq = self.decoding.get(s.uid)
            if seq is None:
                continue
            end = self._emit(seq, s.token, s.logprobs)
            if s.finish is not None or end is not None:
                caches = s.caches if s.caches is not None else self.batch.remove(s.uid)
                self._finish(seq, caches, end or ("stop" if s.finish == "stop" else "length"))

    def _emit(self, seq: Sequence, tok: int, lp: mx.array) -> str | None:
        """Record token ``tok`` (sampled from ``lp``): its event, and why the reply ends
        here ("stop" at an end-of-sequence token), or None."""
        if seq.t_first is None:
            seq.t_first = time.perf_counter()
            seq.first_lp = lp
            p = seq.prefill
            if p.pos < p.n:  # the last prompt token went through the first decode step
                ttft = seq.t_first - p.t0
                seq.handle.emit(PrefillProgress(p.total, p.total, p.total / ttft if ttft else 0.0))
            self.engine._last = p.metrics(seq.t_first - p.t0)
        seq.tokens.append(tok)
        if len(seq.logprobs) < seq.record:
            seq.logprobs.append(np.array(lp.astype(mx.float32)))
        if tok in seq.eos:
            return "stop"
        seq.detok.add_token(tok)
        if seq.stops.stops:  # stop strings: hold back what may begin one
            safe, hit = seq.stops.feed(seq.detok.text)
            seq.handle.emit(TokenBatch((tok,), safe[len(seq.shown) :]))
            seq.shown = safe
            if hit:
                return "stop"
        else:
            seq.handle.emit(TokenBatch((tok,), seq.detok.last_segment))
        return None

    def _finish(self, seq: Sequence, caches: list[Any], reason: str) -> None:
        e, p = self.engine, seq.prefill
        self.decoding.pop(seq.uid, None)
        seq.detok.finalize()
        text = seq.detok.text
        if seq.stops.stops:
            text = seq.stops.feed(text)[0] if reason == "stop" else text
            tail_text = text[len(seq.shown) :]
        else:
            tail_text = seq.detok.last_segment
        if tail_text:
            seq.handle.emit(TokenBatch((), tail_text))
        t_end = time.perf_counter()
        # with the logprobs after the reply's last token, for a continue
        end = seq.end_logits()
        end_lp = logprobs_of(end).reshape(-1) if end is not None and seq.tokens else None
        if end_lp is not None:
            mx.eval(end_lp)
        p.turn.finish(caches, list(seq.req.prompt_ids) + seq.tokens, seq.first_lp, end_lp)
        seq.handle.logprobs = seq.logprobs
        seq.handle.restored_position = p.start
        ttft = (seq.t_first or t_end) - p.t0
        g = len(seq.tokens)
        metrics = dataclasses.replace(
            p.metrics(ttft),
            generation_tokens=g,
            generation_tps=(g - 1) / (t_end - seq.t_first)
            if g > 1 and t_end > seq.t_first
            else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()),
            finish_reason=reason,
            ssd_write_bytes=p.turn.ssd_write_bytes,
        )
        e._last = metrics
        # before Finished: the caller's next stats() has every rank's figures
        e.peers.gather_stats(e.cache, e.monitor.stats)
        stop_sequence = seq.stops.matched if reason == "stop" else None
        seq.handle.emit(Finished(tuple(seq.tokens), text, metrics, stop_sequence))
        self._after(p)
        e._apply_memory_pressure()

    def _after(self, p: Prefill) -> None:
        p.turn.close()
        if p.turn.read_ssd:
            self.engine.release_host_buffers()


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


__all__ = ["Scheduler", "Sequence", "Step", "TurnMetrics"]
