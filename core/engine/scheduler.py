"""Many requests at once: what each engine step does, decided from a view of the requests
(docs/DESIGN.md §20).

The scheduler only decides; the executor (:mod:`.executor`) runs what it decides. A step
is a sequence of typed actions (:mod:`.actions`), decided one at a time:
:meth:`Scheduler.step` yields an action, the caller runs it (the view then shows its
effect) and asks for the next. A step ends the requests cancelled since the last one
(:class:`~.actions.Cancel`), starts queued requests in order (:class:`~.actions.Start`;
one that shares a prefix a prefill in progress will store waits for it,
:meth:`Scheduler.waits`; one whose memory does not fit beside the requests held waits,
and none after it passes it, while one that can never fit, or finds the machine's memory
taken by other programs, is refused, :class:`~.actions.Refuse`, docs/DESIGN.md §11;
requests that arrived during the step's last action are admitted first, through
``arrivals``), runs the rests of the requests that fit one forward together
(:class:`~.actions.Group`) or else one prefill piece of the request at the head of the
prefill queue (:class:`~.actions.Piece`), up to :data:`BUSY_PIECE_S` of prefill work while
others decode, then one batched decode step (:class:`~.actions.Decode`). So a long prompt
neither freezes the other streams nor makes Stop wait longer than one piece.

Its inputs are the view (:class:`View`: the queued, prefilling and decoding requests, the
cache's block size, state layers and kept prefill rate, the prefill step), the measured
cost of a forward (:class:`~.forward_cost.ForwardCost`) and a clock, both passed in: the
policy runs with fakes and no model (``tests/unit/test_schedule_policy.py``). Every
decision that reads the clock or a cancel is rank 0's; across ranks the workers run the
actions rank 0 sends (docs/DESIGN.md §19).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from ..cache.blocks import common_prefix_len
from ..memory.admission import Verdict
from .actions import Action, Cancel, Decode, Group, Piece, Refuse, Start
from .forward_cost import ForwardCost

BUSY_PIECE_S = 0.25  # the most prefill work between two decode steps while others decode
# a lone request's prefill piece on the CPU (prefill_step set) with the folded schedule:
# about this much measured work, so a Stop waits at most one piece without cutting a short
# prompt into many small forwards (each reads every weight again)
LONE_PIECE_S = 0.5
MAX_STARTS = 8  # the most requests started in one round (each restore: ~10 ms on a GPU)
# a Stop acts within about this much prefill work: the floor on a piece never passes it
STOP_S = 1.0


def sizes_up_to(block: int, limit: int) -> list[int]:
    """The few sizes (tokens) a budgeted piece or a group's width takes, ascending: a
    block times 1, 2, 3, 4, 6, 8, 12, 16... (two a doubling), up to ``limit``. MLX
    builds kernels per shape, so a server that cuts pieces at any size pays a build per
    request; a set this small costs a few builds once (docs/DESIGN.md §20)."""
    top = max(limit, block)
    out, size = [], block
    while size <= top:
        out.append(size)
        if size >= 2 * block and size * 3 // 2 <= top:
            out.append(size * 3 // 2)
        size *= 2
    return out


def size_at_most(tokens: int, block: int) -> int:
    """The largest size of :func:`sizes_up_to` within ``tokens`` (one block at least)."""
    return sizes_up_to(block, tokens)[-1]


def size_at_least(tokens: int, block: int) -> int:
    """The smallest size of :func:`sizes_up_to` that holds ``tokens``."""
    return next(x for x in sizes_up_to(block, 2 * max(tokens, block)) if x >= tokens)


class PrefillView(Protocol):
    """What the policy reads of a request's prefill (:class:`~.prefill_steps.Prefill`)."""

    pos: int  # prompt tokens in the cache now
    start: int  # prompt tokens the restore gave
    prompt: list[int]
    checkpoints: set[int]  # schedule points that take state checkpoints
    chunk: int  # the planned chunk (tokens; the memory plan's)

    @property
    def rest(self) -> int: ...
    @property
    def groupable(self) -> bool: ...
    def next_end(self, budget: int | None = None, lone: bool = False) -> int: ...


class RequestView(Protocol):
    """What the policy reads of a request (:class:`~.request.Request`)."""

    uid: int
    params: Any  # GenerateRequest: prompt_ids, use_cache
    prefill: Any  # PrefillView, or None while queued

    @property
    def cancelled(self) -> bool: ...


class CacheView(Protocol):
    """What the policy reads of the prefix cache."""

    block_size: int
    state: Any  # truthy when the model has state layers (restores at checkpoints only)
    prefill_rate: float  # tokens/s of whole prefills, kept across restarts (0: unknown)


class View(Protocol):
    """The requests the executor holds, in order, and the facts the policy needs."""

    queued: Sequence[Any]
    prefilling: Sequence[Any]
    decoding: Mapping[int, Any]
    cache: CacheView | None
    prefill_step: int  # tokens (0: chunks are not cut)
    block_size: int  # tokens: the cache's block (the settings' with the cache off)

    def memory(self, r: Any) -> tuple[Verdict, str]:
        """Whether queued ``r`` fits memory beside the requests held
        (:func:`~..memory.admission.verdict`) and, for a refusal, why (a message)."""
        ...


class Scheduler:
    """Decides each step's actions (:meth:`step`) from a :class:`View`.

    ``prefill_chunk`` and ``bitwise``: the settings; ``cost``: the measured forwards (the
    executor adds to it); ``clock()``: seconds, for the step's prefill budget;
    ``arrivals()``: admits the requests that arrived since (rank 0's engine; None: none)."""

    def __init__(
        self,
        prefill_chunk: int,
        bitwise: bool,
        cost: ForwardCost | None = None,
        clock: Callable[[], float] = time.perf_counter,
        arrivals: Callable[[], None] | None = None,
    ) -> None:
        self.prefill_chunk = prefill_chunk
        self.bitwise = bitwise
        self.cost = cost if cost is not None else ForwardCost()
        self.clock = clock
        self.arrivals = arrivals

    def step(self, view: View) -> Iterator[Action]:
        """One bounded step's actions, each yielded once the last one ran: cancels, starts
        (the requests that arrived during the step's last action or restores admitted
        first), prefill groups or pieces (up to :data:`BUSY_PIECE_S` of them while others
        decode, one otherwise; restores apart), one batched decode step."""
        held = [*view.queued, *view.prefilling, *view.decoding.values()]
        cancelled = tuple(r.uid for r in held if r.cancelled)
        if cancelled:
            yield Cancel(cancelled)
        spent = 0.0  # prefill work this step (restores not counted: see below)
        while True:
            # who arrived during the last action starts in this step: after a piece
            # (those that waited for its prefix), and after the restores of a start,
            # so their rests can join this step's group instead of waiting a step
            for _ in range(2):
                if self.arrivals is not None:
                    self.arrivals()
                if not any(not self.waits(view, r) for r in view.queued):
                    break
                yield from self._starts(view)
            if not view.prefilling:
                break
            # the step's prefill budget: restores do not use it up, or a wave of
            # arrivals would see its group cut in two by the time its restores took
            left_s = BUSY_PIECE_S - spent
            t0 = self.clock()
            group, width = self.group(view, left_s)
            if group:
                yield Group(tuple(r.uid for r in group), width)
            else:
                head = view.prefilling[0]
                yield Piece(head.uid, self.piece_end(view, head, left_s))
            spent += self.clock() - t0
            if not view.decoding or spent >= BUSY_PIECE_S:
                break
            if any(r.cancelled for r in view.prefilling):
                break
        if view.decoding:
            yield Decode()

    def _starts(self, view: View) -> Iterator[Start | Refuse]:
        """One round of starts: the queued requests in order, up to :data:`MAX_STARTS`,
        passing over those that :meth:`waits` (asked again after each start, whose
        prefill may be the one a later request waits for). A request whose memory does
        not fit beside the requests held (``view.memory``: "wait") ends the round: none
        after it passes it, so a large request is not starved by smaller ones; one that
        can never fit, or finds the machine's memory taken ("never", "busy"), is refused."""
        started = 0
        for r in list(view.queued):
            if started >= MAX_STARTS:
                return
            if r not in view.queued or self.waits(view, r):
                continue
            verdict, why = view.memory(r)
            if verdict == "wait":
                return
            if verdict != "start":
                yield Refuse(r.uid, why, verdict == "never")
                continue
            started += 1
            yield Start(r.uid)

    def waits(self, view: View, r: Any) -> bool:
        """Whether queued ``r`` should wait for a request in prefill that will store a
        prefix they share (at least a block more than that request restored; with state
        layers, up to one of its checkpoints), when its rest is at most twice what waiting
        saves: clients arriving together with one new system prompt compute it once, then
        restore it. A function of the requests' tokens and positions only, so every rank
        decides alike."""
        cache = view.cache
        if cache is None or not r.params.use_cache:
            return False
        for other in view.prefilling:
            p = other.prefill
            if not other.params.use_cache or other.params.measure:  # stores nothing
                continue
            reach = common_prefix_len(r.params.prompt_ids, p.prompt)
            if cache.state:  # state layers restore at its checkpoints only
                reach = max((x for x in p.checkpoints if x <= reach), default=0)
            gain = reach - p.start
            if gain >= cache.block_size and p.rest <= 2 * gain:
                return True
        return False

    def piece_end(self, view: View, r: Any, left_s: float) -> int:
        """Where the next prefill piece of ``r`` ends: the next cut, or sooner where
        others wait and the measured cost says ``left_s`` seconds do less. A budget is
        one of few sizes (:func:`size_at_most`), never under :meth:`min_piece`."""
        budget, lone = None, False
        if view.decoding or len(view.prefilling) > 1 or view.queued:
            budget = self.cost.tokens_in(max(left_s, 0.05))  # what fits the step's time left
        elif view.prefill_step and not self.bitwise:
            budget = self._lone_budget(view)
            lone = budget is not None
        if budget is not None:
            budget = size_at_most(max(budget, self.min_piece(view)), view.block_size)
        return r.prefill.next_end(budget, lone=lone)

    def min_piece(self, view: View) -> int:
        """The floor on a budgeted piece (tokens): the tokens whose marginal cost equals a
        forward's fixed cost (smaller pieces spend most of their time on the fixed part,
        so the rate they measure falls, and the budgets with it: a spiral), as a size of
        :func:`sizes_up_to`, but never more than :data:`STOP_S` of work allows; a block
        while nothing is measured."""
        block = view.block_size
        fixed, per_token = self.cost.fit()
        if per_token <= 0:
            return block
        even = size_at_least(int(fixed / per_token), block)
        stop = self.cost.tokens_in(STOP_S) or block
        return even if even <= stop else size_at_most(stop, block)

    def _lone_budget(self, view: View) -> int | None:
        """Tokens of about :data:`LONE_PIECE_S` of work: by the forwards measured, or a
        whole prefill's rate (kept across restarts) where that says more."""
        fitted = self.cost.tokens_in(LONE_PIECE_S) or 0
        return max(fitted, _kept_tokens(view, LONE_PIECE_S)) or None

    def group(self, view: View, left_s: float) -> tuple[list[Any], int]:
        """The requests whose rests go through the model together next (:mod:`.prefill_batch`)
        and the forward's width: in order, the groupable ones while the padded batch (rows
        x the longest rest, padded to a size of :func:`sizes_up_to`, so groups run few
        shapes; unpadded where two rows fit only so) fits a prefill chunk and, at the measured cost (:class:`.ForwardCost`), the
        step's time left while others wait or decode, else :data:`LONE_PIECE_S` (on a CPU,
        where a row costs as much in a group as alone, rests rarely group). Fewer than
        two: none (``[], 0``)."""
        limit = self.prefill_chunk
        # a group is one forward: at most a piece's time, so Stop waits no longer
        if view.decoding or view.queued:
            left_s = max(left_s, 0.05)
            # none measured yet: by the kept whole-prefill rate
            fits = self.cost.tokens_in(left_s) or _kept_tokens(view, left_s) or None
        else:
            fits = self._lone_budget(view)
        if fits is not None:
            limit = min(limit, fits)
        group: list[Any] = []
        longest = width = 0
        pad = True  # off where two rows fit only unpadded: a group beats a known shape
        for r in view.prefilling:
            p = r.prefill
            if not p.groupable:
                continue
            rest = max(longest, p.rest)
            cap = min(limit, p.chunk)  # no row's planned chunk (its memory plan) exceeded
            w = size_at_least(rest, view.block_size) if pad else rest
            rows = len(group) + 1
            if rows <= 2 and rows * w > cap >= rows * rest:
                pad, w = False, rest
            if rows * w > cap:
                continue
            group.append(r)
            longest, width, limit = rest, w, cap
        return (group, width) if len(group) > 1 else ([], 0)


def _kept_tokens(view: View, seconds: float) -> int:
    """Tokens of ``seconds`` at the cache's whole-prefill rate kept across restarts (0:
    none known)."""
    cache = view.cache
    return int((cache.prefill_rate if cache is not None else 0.0) * seconds)
