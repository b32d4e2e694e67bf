"""One request's prefill, in pieces the scheduler interleaves with decode steps
(docs/DESIGN.md §9, §20).

The prompt's schedule is as before batching: restore the furthest cached prefix, then the
chunks of :func:`~.cache.schedule.schedule_points` from there (the folded schedule's last
chunk ends at ``N`` and gives the first token's logprobs), each capturing what the cache
tiers keep. A *piece* is the work of one scheduler step: a whole chunk, or part of one.

- The engine's fixed ``prefill_step`` (tokens, set at load, 0: none) cuts chunks at its
  absolute multiples, which join the bitwise schedule's points (without state checkpoints):
  a function of positions only, so a cold run and a run restored at any point cut at the
  same places and stay bit-identical, and a cancelled prefill's retry restores each
  finished piece (blocks and the resident cache: attention layers).
- While other requests wait or decode, a piece also stops after ``budget`` tokens (from the
  measured prefill rate, aligned down to the block size) -- on schedules that promise float
  rounding only (not ``bitwise``), where where a cut falls changes nothing but rounding.

Checkpoints of state layers are taken at schedule points only; a piece that ends inside a
chunk captures its blocks and window slices (a later piece would overwrite them). A cancel
between pieces keeps everything computed so far (:meth:`CacheRequest.cancel`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from ..api import Event, GenerateRequest, PrefillProgress, TurnMetrics
from ..cache.plans import Restored
from ..cache.request import CacheRequest, ColdRequest, MeasureRequest
from ..cache.schedule import chunk_ends, schedule_points
from ..memory import readings
from .forward import logprobs_of
from .ranks import PREFILL_FAILED, PREFILL_OK, RESTORE_SHORT
from .sampling import RequestSampling, make_request_sampler

if TYPE_CHECKING:
    from .ranks import Agreed, Turn
    from .runtime import Runtime


_pieces = 0  # prefill pieces captured in this process (the test fault below counts them)


def _test_fault() -> None:
    """Tests only: ``TIERCHAT_TEST_FAIL_PREFILL=R:K`` makes the capture of the ``K``-th
    prefill piece of this process raise on rank ``R`` (``MLX_RANK``; 0 alone): a
    rank's own failure in a prefill (docs/DESIGN.md §19)."""
    global _pieces
    spec = os.environ.get("TIERCHAT_TEST_FAIL_PREFILL")
    if not spec:
        return
    _pieces += 1
    rank, _, k = spec.partition(":")
    if rank == os.environ.get("MLX_RANK", "0") and str(_pieces) == k:
        raise RuntimeError(f"test fault: prefill piece {k} on rank {rank}")


def open_cache_request(
    runtime: Runtime, req: GenerateRequest, points: list[int], sampling: RequestSampling
) -> CacheRequest | ColdRequest:
    """The request's cache object (docs/DESIGN.md §9): a :class:`CacheRequest` over the
    runtime's prefix cache for the schedule ``points``, or a :class:`ColdRequest` with the
    cache off (for this request or the engine)."""
    cache, fresh = runtime.cache, runtime.make_cache
    if cache is None:
        return ColdRequest(fresh)
    if not req.use_cache:
        return cache.begin_cold(fresh)
    # processors need the first token's logits: such a request restores at most N - 1
    # (the cache keeps the model's own logprobs)
    limit = len(req.prompt_ids) - 1 if sampling.needs_logits else None
    if req.measure:  # a verify's cached run: counted nowhere, stores nothing (§18)
        whole = req.prompt_ids + req.teacher_ids
        return MeasureRequest(cache, req.prompt_ids, points, req.boundaries, fresh, whole, limit)
    return cache.begin(req.prompt_ids, points, req.boundaries, fresh, limit)


class Prefill:
    """The prefill state of one request: ``pos`` of ``n`` prompt tokens in ``caches``,
    ``first_logprobs`` (shape ``(vocab,)``) once a folded last chunk or a kept tail gave
    them, and ``first_sample`` (the same with the request's logits processors applied,
    or None: sample from ``first_logprobs``). ``sampling``: the request's sampler,
    processors and stop strings; ``cache_request``: its cache object (docs/DESIGN.md §9);
    ``emit``: sends its progress events. Made by :meth:`begin`; advanced by :meth:`piece`."""

    def __init__(
        self,
        runtime: Runtime,
        req: GenerateRequest,
        emit: Callable[[Event], None],
        cache_request: CacheRequest | ColdRequest,
        restored: Restored,
        ends: list[int],
        t0: float,
        sampling: RequestSampling,
        bitwise: bool,
        block: int,
    ) -> None:
        self.runtime, self.req, self.emit = runtime, req, emit
        self.cache_request = cache_request
        self.bitwise, self.block = bitwise, block
        self.sampling = sampling
        self.first_sample: mx.array | None = None
        self.restored = restored
        # the cache list is this prefill's from here on: the restore's record keeps its
        # figures only, so the caches go when the prefill lets them go (a batch copy
        # beside them doubled a decoding request's K/V: docs/DESIGN.md §11)
        self.caches, restored.caches = restored.caches, None
        self.prompt = list(req.prompt_ids)
        self.n = len(self.prompt)
        self.start = self.pos = restored.position
        self.ends = ends
        self.t0 = t0
        self.restore_s = time.perf_counter() - t0
        self.first_logprobs = restored.first_logprobs if self.start == self.n else None
        self.total = self.n - self.start
        self.checkpoints: set[int] = set()  # the schedule points that take state checkpoints
        self.chunk = 0  # the planned chunk (tokens; memory)
        self.failure = PREFILL_OK  # this rank's prefill went wrong (a code of .ranks)
        self.why = ""

    @classmethod
    def begin(
        cls,
        runtime: Runtime,
        req: GenerateRequest,
        agree: Callable[[Callable[[int], Turn]], Agreed],
        emit: Callable[[Event], None],
        bitwise: bool,
        block: int,
    ) -> Prefill:
        """Agree the request's start through ``agree`` (the peers': the chunk from the
        memory plan, one restore position on every rank, docs/DESIGN.md §19), which opens
        the request's cache object for the schedule of the chunk it settles on
        (``open_turn(chunk)``) and restores through it. ``bitwise``: the schedule promises
        bit-identical results (pieces cut at its points only); ``block``: the cache's
        block size (tokens; budgeted pieces end at its multiples).

        Raises:
            memory.prefill.PrefillRefused: a rank has no chunk that fits its memory.
        """
        n = len(req.prompt_ids)
        plan = runtime.plan
        fold = plan.folds
        sampling = make_request_sampler(req)  # the one place sampling is built (§2)
        schedules: dict[int, tuple[list[int], set[int]]] = {}

        def open_turn(chunk: int) -> Turn:
            points = schedule_points(n, chunk, req.boundaries, fold=fold)
            checkpoints = set(points)
            step = plan.step
            if step and not fold:  # the step's multiples are schedule points too (no checkpoint)
                points = sorted(checkpoints | set(range(step, n - 1, step)))
            schedules[chunk] = (points, checkpoints)
            return open_cache_request(runtime, req, points, sampling)

        t0 = time.perf_counter()
        readings.reset_peak()  # the process's own peak is kept (docs/DESIGN.md §11)
        chunk, cache_request, restored, short = agree(open_turn)
        points, checkpoints = schedules[chunk]
        start = restored.position
        ends = chunk_ends(start, points, chunk if fold else 0)
        limit = plan.fold_limit
        if fold and limit is not None and ends and ends[-1] - max([start, *ends[:-1]]) > limit:
            ends[-1] = n - 1  # too long to fold here: the last token goes to decode
        p = cls(runtime, req, emit, cache_request, restored, ends, t0, sampling, bitwise, block)
        p.checkpoints = checkpoints
        p.chunk = chunk
        if short:  # this rank holds fewer tokens than the others: nothing of it is stored
            p.fail(RESTORE_SHORT, "its restore landed below the agreed position")
        if ends:  # the prefill starts: its first piece may take long (a CPU, a long prompt)
            emit(PrefillProgress(0, p.total, 0.0))
        return p

    def fail(self, failure: int, why: str) -> None:
        """This rank's prefill of the request went wrong (``failure``: a code of
        :mod:`.ranks`): it goes on computing the same pieces as the other ranks (their
        collectives meet), captures nothing more, and the prefill's agreement voids it."""
        if not self.failure:
            self.failure, self.why = failure, why
            self.cache_request.log(f"prefill failed here: {why}")

    def capture(self, start: int, end: int) -> list[mx.array]:
        """The cache request's captures of the piece ``[start, end)`` just computed
        (:meth:`~.cache.request.CacheRequest.chunk`); none once this rank's prefill
        failed, and an error there fails it (:meth:`fail`) rather than the ranks."""
        if self.failure:
            return []
        try:
            _test_fault()
            return self.cache_request.chunk(
                self.caches, start, end, self.first_logprobs, checkpoint=end in self.checkpoints
            )
        except Exception as exc:  # noqa: BLE001 -- this rank's own work: the request fails
            self.fail(PREFILL_FAILED, f"{type(exc).__name__}: {exc}")
            return []

    @property
    def finished(self) -> bool:
        """Every prompt token that prefill computes is in the cache."""
        return not self.ends or self.pos >= self.ends[-1]

    @property
    def done(self) -> int:
        return self.pos - self.start

    @property
    def rest(self) -> int:
        """The tokens still to prefill (to the last schedule end)."""
        return self.ends[-1] - self.pos if self.ends else 0

    @property
    def groupable(self) -> bool:
        """Whether the rest can be prefilled in a group (docs/DESIGN.md §20): every layer
        cache a plain or quantized KV cache (``KVCache``, ``QuantizedKVCache``) or a state
        cache (``ArraysCache`` and its kinds), not
        ``bitwise``, something left to compute, and with state layers one schedule end
        left (their checkpoints are taken at chunk ends, which a group does not stop at)."""
        if self.finished or self.bitwise:
            return False
        kv = (KVCache, QuantizedKVCache)
        if not all(type(c) in kv or isinstance(c, ArraysCache) for c in self.caches):
            return False
        state = any(isinstance(c, ArraysCache) for c in self.caches)
        return not state or [x for x in self.ends if x > self.pos] == [self.ends[-1]]

    def next_end(self, budget: int | None = None, lone: bool = False) -> int:
        """Where the next piece ends: the next cut of the schedule, or sooner, after at most
        ``budget`` tokens, where the schedule allows cuts anywhere (None: the next cut).
        ``lone`` (a request prefilling alone, folded schedule): ``budget`` replaces the
        ``prefill_step`` cuts, which would split a short prompt into many forwards."""
        pos = self.pos
        end = next(x for x in self.ends if x > pos)
        step = self.runtime.plan.step
        if lone and budget is not None and not self.bitwise:
            return min(end, pos + max(budget, step, 1))
        if step:
            end = min(end, (pos // step + 1) * step)
        if budget is not None and not self.bitwise and pos + budget < end:
            # cut at a block end within the budget (none when the rest of the chunk fits)
            block = self.block
            cut = (pos + budget) // block * block
            end = min(end, max(cut, (pos // block + 1) * block))
        return end

    def piece(self, end: int | None = None) -> int:
        """Prefill the next piece, to ``end`` (from :meth:`next_end`; None: the next cut).
        Returns the tokens computed."""
        pos, n = self.pos, self.n
        end = self.next_end() if end is None else end
        tokens_in = mx.array(self.prompt[pos:end])[None]
        computed = []
        if end == n:  # folded: this piece gives the first token's logits
            logits = self.runtime.plan.last_logits(tokens_in, self.caches)
            self.first_logprobs = logprobs_of(logits).squeeze(0)  # kept: pre-processor
            computed.append(self.first_logprobs)
            if self.sampling.needs_logits:
                first = self.sampling.first_logprobs(logits.reshape(1, -1), self.prompt)
                self.first_sample = first
                computed.append(first)
        else:
            self.runtime.model(tokens_in, cache=self.caches)
        computed += [c.state for c in self.caches]
        computed += self.capture(pos, end)
        mx.eval(computed)  # the forward and its collectives, failed here or not
        self.pos = end
        dt = time.perf_counter() - self.t0
        self.emit(PrefillProgress(self.done, self.total, self.done / dt if dt > 0 else 0.0))
        return end - pos

    def cancel(self) -> int:
        """Stop here, keeping what the finished pieces computed; returns the tokens kept."""
        return self.cache_request.cancel(self.caches, self.pos)

    def first_token(self) -> None:
        """The sequence leaves prefill: complete the captured entries (KV slices) while
        its own cache list still holds them, and let the SSD writer run."""
        self.cache_request.first_token(self.caches)

    def metrics(self, ttft: float) -> TurnMetrics:
        """What the request reused and its TTFT (seconds), known at its first token."""
        r = self.restored
        return TurnMetrics(
            prompt_tokens=self.n,
            cached_tokens=self.start,
            cached_by=dict(r.cached_by),
            cached_kind=dict(r.cached_kind),
            prefill_tokens=self.n - self.start,
            ttft_s=ttft,
            prefill_tps=(self.n - self.start) / ttft if ttft > 0 else 0.0,
            restore_s=self.restore_s,
            restore_bytes=r.nbytes,
            restore_choice=r.choice.describe() if r.choice else "",
        )
