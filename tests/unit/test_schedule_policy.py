"""The scheduler's policy (core/engine/scheduler.py) with fakes: no model, no MLX work, an
injected cost model and clock (docs/DESIGN.md §20).

A fake executor holds requests with fake prefills and runs each action the scheduler
yields (a start moves a request to prefill, a piece advances it, a group finishes its
rows); the fake clock moves only when an action runs, by what that action costs at a
fixed rate. So every decision here follows from the requests and the costs alone.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
from tierchat.core.api import GenerateRequest
from tierchat.core.cache.blocks import common_prefix_len
from tierchat.core.engine.actions import Cancel, Decode, Group, Piece, Refuse, Start
from tierchat.core.engine.forward_cost import ForwardCost
from tierchat.core.engine.scheduler import BUSY_PIECE_S, MAX_STARTS, Scheduler

BLOCK = 16
SIZES = {BLOCK * m << k for m in (1, 3) for k in range(10)}  # 16, 32, 48, 64, 96...
SYSTEM = tuple(range(1000, 1100))  # a 100-token system prompt


@dataclasses.dataclass
class FakePrefill:
    prompt: list[int]
    start: int = 0
    chunk: int = 256
    groupable: bool = True
    checkpoints: set[int] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.pos = self.start
        self.budgets: list[tuple[int | None, bool]] = []

    @property
    def rest(self) -> int:
        return len(self.prompt) - self.pos

    def next_end(self, budget: int | None = None, lone: bool = False) -> int:
        self.budgets.append((budget, lone))
        end = len(self.prompt)
        if budget is not None and self.pos + budget < end:
            end = max(self.pos + budget // BLOCK * BLOCK, self.pos + BLOCK)
        return min(end, len(self.prompt))


@dataclasses.dataclass(eq=False)
class FakeRequest:
    uid: int
    params: GenerateRequest
    restores: int = 0  # prompt tokens its start will restore
    cancelled: bool = False
    prefill: FakePrefill | None = None


@dataclasses.dataclass
class FakeCache:
    block_size: int = BLOCK
    state: bool = False
    prefill_rate: float = 0.0


class FakeExecutor:
    """The view the scheduler reads, and a runner of its actions. A forward of n tokens
    costs ``floor + n / rate`` seconds on the clock; a start, ``restore_s``."""

    def __init__(self, rate: float = 1000.0, floor: float = 0.0, restore_s: float = 0.0):
        self.queued: deque[FakeRequest] = deque()
        self.prefilling: deque[FakeRequest] = deque()
        self.decoding: dict[int, FakeRequest] = {}
        self.cache: FakeCache | None = FakeCache()
        self.prefill_step = 0
        self.block_size = BLOCK
        self.now = 0.0
        self.rate, self.floor, self.restore_s = rate, floor, restore_s
        self.ran: list = []
        self.shared: dict[tuple[int, ...], int] = {}  # prefixes stored by finished prefills
        self.uids = 0
        # memory admission (tests/unit/test_memory_admission.py): (verdict, why) of a
        # queued request; None: every request fits
        self.memory_verdict = None
        self.refused: list[Refuse] = []

    def memory(self, r):
        return self.memory_verdict(r) if self.memory_verdict is not None else ("start", "")

    def clock(self) -> float:
        return self.now

    def add(self, prompt: tuple[int, ...], restores: int = 0, use_cache: bool = True) -> int:
        self.uids += 1
        uid = self.uids
        params = GenerateRequest(prompt_ids=prompt, use_cache=use_cache)
        self.queued.append(FakeRequest(uid, params, restores))
        return uid

    def run(self, action) -> None:
        self.ran.append(action)
        if isinstance(action, Cancel):
            for q in (self.queued, self.prefilling):
                for r in [r for r in q if r.uid in action.uids]:
                    q.remove(r)
            for uid in action.uids:
                self.decoding.pop(uid, None)
        elif isinstance(action, Refuse):
            r = next(r for r in self.queued if r.uid == action.uid)
            self.queued.remove(r)
            self.refused.append(action)
        elif isinstance(action, Start):
            r = next(r for r in self.queued if r.uid == action.uid)
            self.queued.remove(r)
            self.now += self.restore_s
            prompt = list(r.params.prompt_ids)
            # the blocks a finished prefill stored restore, as a cache's would
            stored = max((common_prefix_len(prompt, list(p)) for p in self.shared), default=0)
            r.prefill = FakePrefill(prompt, start=max(r.restores, stored // BLOCK * BLOCK))
            self.prefilling.append(r)
        elif isinstance(action, Piece):
            r = self.prefilling[0]
            assert r.uid == action.uid
            self._forward(action.end - r.prefill.pos)
            r.prefill.pos = action.end
            if r.prefill.rest == 0:
                self._joined(self.prefilling.popleft())
        elif isinstance(action, Group):
            rows = [r for r in self.prefilling if r.uid in action.uids]
            self._forward(len(rows) * action.width)
            for r in rows:
                r.prefill.pos = len(r.prefill.prompt)
                self.prefilling.remove(r)
                self._joined(r)
        elif isinstance(action, Decode):
            self.now += 0.02

    def _forward(self, tokens: int) -> None:
        self.now += self.floor + tokens / self.rate

    def _joined(self, r: FakeRequest) -> None:
        self.decoding[r.uid] = r
        self.shared[tuple(r.prefill.prompt)] = len(r.prefill.prompt)

    def step(self, scheduler: Scheduler) -> list:
        """One step: every action the scheduler decides, each run before the next."""
        first = len(self.ran)
        for action in scheduler.step(self):
            self.run(action)
        return self.ran[first:]


def _measured(rate: float, fixed: float = 0.0, sizes=(50, 200, 50, 200)) -> ForwardCost:
    """A cost model that measured forwards of ``sizes`` at ``fixed + n / rate`` seconds."""
    cost = ForwardCost()
    for n in sizes:
        cost.add(n, fixed + n / rate)
    return cost


def _beside_a_decode(rate: float, fixed: float = 0.0) -> FakeExecutor:
    """A fake executor whose forwards cost ``fixed + n / rate``, one request decoding."""
    ex = FakeExecutor(rate=rate, floor=fixed)
    ex.decoding[999] = FakeRequest(999, GenerateRequest(prompt_ids=(1,)))
    return ex


def _scheduler(ex: FakeExecutor, cost: ForwardCost | None = None, **kw) -> Scheduler:
    return Scheduler(prefill_chunk=256, bitwise=False, cost=cost, clock=ex.clock, **kw)


def _rest(n: int, seed: int) -> tuple[int, ...]:
    return tuple(range(seed * 1000, seed * 1000 + n))


def test_an_idle_view_decides_nothing():
    ex = FakeExecutor()
    assert ex.step(_scheduler(ex)) == []


def test_cancels_come_first_and_name_every_cancelled_request():
    ex = FakeExecutor()
    a, b = ex.add(_rest(40, 1)), ex.add(_rest(40, 2))
    ex.step(_scheduler(ex))  # both start, prefill, decode
    c = ex.add(_rest(30, 3))
    ex.decoding[a].cancelled = True
    ex.queued[0].cancelled = True
    actions = ex.step(_scheduler(ex))
    assert actions[0] == Cancel((c, a))  # queued first, then decoding (the held order)
    assert b in ex.decoding and a not in ex.decoding


def test_requests_sharing_a_new_system_prompt_wait_then_their_rests_go_in_one_group():
    """Five requests with one new system prompt arrive together: the first starts and the
    others wait for the prefix it will store; after its prefill they restore it and their
    rests (16 to 37 tokens) go through one forward. No cost measured: the group's only
    limit is the chunk. The deterministic form of the engine test's group size."""
    ex = FakeExecutor()
    uids = [ex.add(SYSTEM + _rest(16 + 7 * k, k + 1)) for k in range(5)]
    actions = ex.step(_scheduler(ex))
    assert actions[0] == Start(uids[0])
    assert actions[1] == Piece(uids[0], len(SYSTEM) + 16)
    assert actions[2:6] == [Start(u) for u in uids[1:]]
    assert actions[6] == Group(tuple(uids[1:]), 48)  # rests of 20 to 41 tokens, padded
    assert actions[7:] == [Decode()]
    for uid in uids[1:]:
        assert ex.decoding[uid].prefill.start == len(SYSTEM) // BLOCK * BLOCK


def test_a_request_sharing_little_or_behind_a_long_rest_starts_at_once():
    """Behind a 180-token rest, a request sharing 20 tokens (under two blocks of gain for
    a rest of 180) or nothing starts at once; behind a 500-token rest, so does one that
    shares the whole system prompt (waiting saves 96 tokens for 400 more to wait)."""
    ex = FakeExecutor()
    first = ex.add(SYSTEM + _rest(80, 1))
    little = ex.add(SYSTEM[:20] + _rest(30, 2))
    none = ex.add(_rest(8, 3))
    shares = ex.add(SYSTEM + _rest(12, 4))
    actions = ex.step(_scheduler(ex))
    assert actions[:3] == [Start(first), Start(little), Start(none)]
    assert Start(shares) in actions and actions.index(Start(shares)) > 3
    ex = FakeExecutor()
    ex.add(SYSTEM + _rest(400, 5))
    ex.add(SYSTEM + _rest(12, 6))
    actions = ex.step(_scheduler(ex))
    assert actions[:2] == [Start(1), Start(2)]


def test_starts_per_round_are_bounded():
    ex = FakeExecutor()
    for k in range(MAX_STARTS + 3):
        ex.add(_rest(20, k + 1))
    actions = ex.step(_scheduler(ex))
    starts = [a for a in actions if isinstance(a, Start)]
    # a round starts MAX_STARTS; the second round of the same pass starts the rest
    assert actions[:MAX_STARTS] == starts[:MAX_STARTS]
    assert len(starts) == MAX_STARTS + 3


def test_the_group_is_cut_to_what_the_measured_cost_fits_in_the_steps_time():
    """While others decode, a group is one forward of at most the step's time left: at
    1000 tokens/s measured, 0.25 s fits 250 tokens, so of four 80-token rests, padded to
    96, two go together (2 x 96 = 192; three would be 288)."""
    cost, ex = _measured(1000.0, sizes=(100, 400, 100, 400)), _beside_a_decode(1000.0)
    uids = [ex.add(_rest(80, k + 1)) for k in range(4)]
    actions = ex.step(_scheduler(ex, cost))
    groups = [a for a in actions if isinstance(a, Group)]
    assert groups[0] == Group(tuple(uids[:2]), 96)
    assert actions[-1] == Decode()


def test_prefill_pieces_stop_at_the_steps_budget_while_others_decode():
    """A 2,000-token prompt while another request decodes: pieces of what the fitted cost
    allows in the time left, until the step has spent BUSY_PIECE_S of prefill work, then
    the decode step; the rest waits for later steps."""
    cost, ex = _measured(1000.0), _beside_a_decode(1000.0)
    uid = ex.add(_rest(2000, 1))
    actions = ex.step(_scheduler(ex, cost))
    pieces = [a for a in actions if isinstance(a, Piece)]
    assert actions[0] == Start(uid) and actions[-1] == Decode()
    assert pieces[0] == Piece(uid, 192)  # 0.25 s at 1000 tokens/s: the size below 250
    done = pieces[-1].end
    assert BUSY_PIECE_S * 1000 <= done <= BUSY_PIECE_S * 1000 + 64
    assert ex.prefilling[0].prefill.pos == done < 2000


def test_a_cancel_during_prefill_ends_the_steps_pieces_and_the_next_step_reaps_it():
    """A request cancelled between two pieces: the step runs no further piece of it (a
    Stop waits one piece at most), decodes the others, and the next step's first action
    cancels it."""
    cost, ex = _measured(1000.0), _beside_a_decode(1000.0)
    uid = ex.add(_rest(2000, 1))
    scheduler = _scheduler(ex, cost)
    steps = scheduler.step(ex)
    assert next(steps) == Start(uid)
    ex.run(Start(uid))
    piece = next(steps)
    assert isinstance(piece, Piece)
    ex.run(piece)
    ex.prefilling[0].cancelled = True  # the caller pressed Stop during the piece
    assert list(steps) == [Decode()]
    assert ex.step(scheduler)[0] == Cancel((uid,))


def test_requests_arriving_during_a_start_join_that_steps_group():
    """``arrivals`` is asked before each round of starts: a request that arrives while
    the first one restores starts in the same step, and their rests go together."""
    ex = FakeExecutor()
    ex.shared[SYSTEM] = len(SYSTEM)
    first = ex.add(SYSTEM + _rest(20, 1))
    calls: list[int] = []
    late: list[int] = []

    def arrivals() -> None:
        calls.append(len(ex.prefilling))
        if len(calls) == 2:
            late.append(ex.add(SYSTEM + _rest(21, 2)))

    actions = ex.step(_scheduler(ex, arrivals=arrivals))
    assert calls[:2] == [0, 1]
    # rests of 24 and 25 tokens: one forward 32 wide
    assert actions[:3] == [Start(first), Start(late[0]), Group((first, late[0]), 32)]


def test_a_lone_prefill_takes_pieces_of_the_kept_rate_or_the_fit():
    """Alone, with a prefill step (the CPU) on the folded schedule, a piece is about
    LONE_PIECE_S of work by the larger of the fitted cost and the kept rate; nothing
    known: the schedule's next cut."""
    ex = FakeExecutor()
    ex.prefill_step = 16
    ex.add(_rest(5000, 1))
    scheduler = _scheduler(ex)
    actions = ex.step(scheduler)
    assert actions[1] == Piece(1, 5000)  # no rate known: the next cut (the whole prompt)
    ex = FakeExecutor()
    ex.prefill_step = 16
    ex.cache.prefill_rate = 1000.0
    ex.add(_rest(5000, 1))
    ex.step(scheduler)
    assert ex.prefilling[0].prefill.budgets[-1] == (384, True)  # 500 tokens: the size below


@pytest.mark.parametrize("bitwise", [True, False])
def test_a_bitwise_schedule_never_takes_budgeted_lone_pieces(bitwise):
    ex = FakeExecutor()
    ex.prefill_step = 16
    ex.cache.prefill_rate = 1000.0
    ex.add(_rest(5000, 1))
    scheduler = Scheduler(prefill_chunk=256, bitwise=bitwise, clock=ex.clock)
    ex.step(scheduler)
    budget, lone = (ex.prefilling or [ex.decoding[1]])[0].prefill.budgets[-1]
    assert lone is not bitwise and (budget is None) is bitwise


# ---------------------------------------------------------------- few shapes


def _sizes_of(actions, ex_before: dict[int, int]) -> list[int]:
    """The lengths of the pieces in ``actions`` (from each request's position before)."""
    out, pos = [], dict(ex_before)
    for a in actions:
        if isinstance(a, Piece):
            out.append(a.end - pos[a.uid])
            pos[a.uid] = a.end
    return out


def test_budgeted_pieces_take_a_few_sizes_whatever_the_measured_rate():
    """While others decode, a long prompt's pieces take sizes from a fixed set (a block
    times 1, 2, 3, 4, 6, 8...), whatever the measured rate: before, any rate and any time
    left gave a size of its own, and each new size built its kernels on a GPU."""
    sizes = set()
    for rate in range(700, 1700, 100):
        cost, ex = _measured(rate, 0.002), _beside_a_decode(rate, 0.002)
        uid = ex.add(_rest(4000, 1))
        actions = ex.step(_scheduler(ex, cost))
        sizes.update(_sizes_of(actions, {uid: 0}))
    assert sizes <= SIZES


def test_lone_pieces_take_a_few_sizes():
    """Alone, 0.5 s of 900 to 1,300 tokens/s (450 to 650 tokens) is cut to the size at or
    below it: 384 or 512 tokens, two shapes for four rates."""
    budgets = set()
    for rate in (900.0, 1000.0, 1100.0, 1300.0):
        ex = FakeExecutor()
        ex.prefill_step = 16
        ex.cache.prefill_rate = rate
        ex.add(_rest(5000, 1))
        ex.step(_scheduler(ex))
        budget, lone = ex.prefilling[0].prefill.budgets[-1]
        assert lone and budget <= rate * 0.5
        budgets.add(budget)
    assert budgets == {384, 512}


def test_pieces_never_spiral_down_under_a_slow_device():
    """A device whose every forward costs a large fixed part (a loaded CPU: 0.2 s a
    forward, 50 tokens/s beyond it) and a step with little time left: the piece is not
    cut below what a forward's fixed cost is worth (the tokens whose marginal cost equals
    it), so the rate measured from the pieces does not fall with their size."""
    cost, ex = _measured(50.0, 0.2, sizes=(16, 64, 16, 64, 32)), _beside_a_decode(50.0, 0.2)
    uid = ex.add(_rest(3000, 1))
    actions = ex.step(_scheduler(ex, cost))
    sizes = _sizes_of(actions, {uid: 0})
    assert sizes and min(sizes) >= 0.2 * 50  # >= 10 tokens: the floor's worth
    assert sizes[0] == BLOCK  # 16 tokens: within 1 s of work (Stop acts in time)


def test_the_floor_never_makes_a_piece_longer_than_stop_allows():
    """Where a forward's fixed cost is worth more than a second of tokens, the floor is
    what one second allows: a Stop still acts within about a second."""
    cost = _measured(1000.0, 0.8, sizes=(64, 256, 64, 256))
    sched = Scheduler(prefill_chunk=4096, bitwise=False, cost=cost)
    view = FakeExecutor()
    assert sched.min_piece(view) <= 256  # tokens_in(1 s) = 200: the size at or below it


def test_a_groups_width_is_padded_to_one_of_few_sizes():
    """Rests of 20 to 36 tokens group at a padded width of 48 (three blocks: the sizes are
    a block times 1, 2, 3, 4, 6, 8, 12...), so groups of other rests of that range run
    one shape."""
    ex = FakeExecutor()
    uids = [ex.add(_rest(20 + 4 * k, k + 1)) for k in range(5)]
    actions = ex.step(_scheduler(ex))
    [group] = [a for a in actions if isinstance(a, Group)]
    assert group.uids == tuple(uids) and group.width == 48


def test_a_padded_group_still_fits_the_chunk():
    """The padded width counts against the chunk: five 60-token rests pad to 64, and a
    256-token chunk takes four rows of them."""
    ex = FakeExecutor()
    uids = [ex.add(_rest(60, k + 1)) for k in range(5)]
    actions = ex.step(_scheduler(ex))
    group = next(a for a in actions if isinstance(a, Group))
    assert group.uids == tuple(uids[:4]) and group.width == 64


def test_rests_group_unpadded_where_only_that_fits_the_chunk():
    """With 16-token chunks, rests of 3 and 5 tokens padded to a block would not fit two
    rows (32 > 16): they go together unpadded, 5 wide (a group beats a known shape)."""
    ex = FakeExecutor()
    uids = [ex.add(_rest(3, 1)), ex.add(_rest(5, 2))]
    scheduler = Scheduler(prefill_chunk=16, bitwise=False, clock=ex.clock)
    actions = ex.step(scheduler)
    assert Group(tuple(uids), 5) in actions
