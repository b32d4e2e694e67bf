"""Admission by memory (core/memory/admission.py) and the scheduler's use of it, with fakes:
no model, no MLX work, an injected clock (docs/DESIGN.md §11, §20).

Footprints are numbers in MB; the fake executor of ``test_schedule_policy`` runs the
scheduler's actions, its ``memory`` verdicts come from real :class:`Reservations` that hold
a request from its start to the end of its reply (a decode step ends every reply here).
"""

from __future__ import annotations

import pytest
from test_schedule_policy import FakeExecutor
from tierchat.core.engine.actions import Decode, Refuse, Start, decode, encode
from tierchat.core.engine.scheduler import Scheduler
from tierchat.core.memory import admission as A
from tierchat.core.memory import pressure as M
from tierchat.core.memory.readings import MemoryReader

MB = 1 << 20


def fp(kv_mb: float, prefill_mb: float = 0.0) -> A.Footprint:
    return A.Footprint(int(kv_mb * MB), int(prefill_mb * MB))


def lines(line_mb: float, limit_line_mb: float | None = None, base_mb: float = 1) -> A.Lines:
    limit = line_mb if limit_line_mb is None else limit_line_mb
    return A.Lines(int(line_mb * MB), int(limit * MB), int(base_mb * MB))


# ------------------------------------------------------------------ the arithmetic


def test_reservations_count_kv_of_all_and_the_largest_prefill_once():
    r = A.Reservations()
    r.hold(1, fp(3, 10))
    assert r.reserved_bytes == 13 * MB  # its K/V and its prefill's scratch
    r.hold(2, fp(3, 14))
    assert r.kv_bytes == 6 * MB and r.scratch_bytes == 14 * MB
    # one forward at a time: the largest scratch counts once, beside a group's merged
    # K/V of the two in prefill
    assert r.group_bytes == 6 * MB and r.reserved_bytes == 6 * MB + 14 * MB + 6 * MB
    r.prefilled(2)  # its prefill is done: only 1's scratch is left, no group
    assert r.reserved_bytes == 16 * MB
    assert r.with_(fp(3, 12)) == 9 * MB + 12 * MB + 6 * MB  # 1 and it may group
    r.keep([2])  # 1 ended (cancelled, failed): nothing of it is reserved
    assert (len(r), r.reserved_bytes) == (1, 6 * MB)  # its K/V, twice as it joins a batch
    r.release(2)
    assert (len(r), r.reserved_bytes) == (0, 0)


def test_verdicts():
    held = A.Reservations()
    held.hold(1, fp(3, 14))
    # 1 base + 3 + 3 kv + 14 scratch + 6 of the two merged in a group = 27
    assert A.verdict(fp(3, 14), held, lines(27)) == "start"
    assert A.verdict(fp(3, 14), held, lines(26)) == "wait"
    held.hold(2, fp(3, 14))
    # a third does not fit beside them, but they will end: it waits, not refused
    assert A.verdict(fp(3, 14), held, lines(27)) == "wait"
    # alone, with empty tiers, over the limit's line: no wait helps
    assert A.verdict(fp(20, 14), held, lines(27)) == "never"
    # nothing of ours held, but other programs lowered the line below the limit's
    assert A.verdict(fp(3, 14), A.Reservations(), lines(10, 27)) == "busy"
    # the same with something held: it waits for it
    assert A.verdict(fp(3, 14), held, lines(10, 27)) == "wait"
    # no limit known: nothing to judge against
    assert A.verdict(fp(300, 14), held, A.Lines(0, 0, MB)) == "start"


def test_tier_room_yields_to_the_reservations():
    r = A.Reservations()
    assert A.tier_room(r, MB, 20 * MB) == 19 * MB
    r.hold(1, fp(3, 10))
    assert A.tier_room(r, MB, 20 * MB) == 6 * MB
    r.hold(2, fp(8, 1))
    assert A.tier_room(r, MB, 20 * MB) == 0  # never below 0
    r.release(1)
    r.release(2)
    assert A.tier_room(r, MB, 20 * MB) == 19 * MB


def test_level_counts_what_is_reserved_not_only_what_is_allocated():
    """16 requests admitted at once read "ok" while their caches had not grown yet
    (before: 9.8x the limit at "ok"); the reservations make it "hard" at admission."""
    reader = MemoryReader(
        mlx=lambda: (2 * MB, 2 * MB, 0), device_info=lambda: {}, system=lambda: (0, 0)
    )
    monitor = M.MemoryMonitor(limit_bytes=25 * MB, reader=reader)
    assert monitor.level() == "ok"
    committed = [24 * MB]
    monitor.committed = lambda: committed[0]
    assert monitor.level() == "hard"
    assert monitor.stats().level == "hard" and monitor.stats().committed == 24 * MB
    committed[0] = 21 * MB
    assert monitor.level() == "soft"
    assert monitor.limit_line() == int(0.92 * 25 * MB)


# ------------------------------------------------------------------ the scheduler


class Gate:
    """The executor's gate over real :class:`Reservations`: a started request holds its
    footprint until its reply ends (the fake's next decode step)."""

    def __init__(self, ex: FakeExecutor, line_mb: float, limit_line_mb: float | None = None):
        self.ex = ex
        self.lines = lines(line_mb, limit_line_mb)
        self.reservations = A.Reservations()
        self.footprints: dict[int, A.Footprint] = {}
        self.most_held = 0
        self.waited: set[int] = set()
        ex.memory_verdict = self.verdict

    def verdict(self, r):
        v = A.verdict(self.footprints[r.uid], self.reservations, self.lines)
        if v == "wait":
            self.waited.add(r.uid)
        return v, "" if v in ("start", "wait") else f"{v}: {r.uid}"

    def add(self, footprint: A.Footprint) -> int:
        uid = self.ex.add(tuple(range(5000 + 100 * self.ex.uids, 5000 + 100 * self.ex.uids + 64)))
        self.footprints[uid] = footprint
        return uid

    def step(self, scheduler: Scheduler) -> list:
        ran = []
        for action in scheduler.step(self.ex):
            self.ex.run(action)
            ran.append(action)
            if isinstance(action, Start):
                self.reservations.hold(action.uid, self.footprints[action.uid])
                held = self.lines.base_bytes + self.reservations.reserved_bytes
                assert held <= self.lines.line_bytes, "admitted past the line"
                self.most_held = max(self.most_held, len(self.reservations))
            if isinstance(action, Decode):  # every reply ends at this step
                for uid in list(self.ex.decoding):
                    del self.ex.decoding[uid]
                    self.reservations.release(uid)
        for r in self.ex.decoding.values():
            self.reservations.prefilled(r.uid)
        return ran


def run_all(gate: Gate, scheduler: Scheduler, limit: int = 200) -> list:
    ran = []
    for _ in range(limit):
        if not (gate.ex.queued or gate.ex.prefilling or gate.ex.decoding):
            return ran
        ran += gate.step(scheduler)
    raise AssertionError("requests still held after many steps")


def test_sixteen_requests_wait_their_turn_none_refused():
    ex = FakeExecutor()
    # 1 base + 3 kv each, 14 scratch and the group's merged K/V: 4 at once (39), not 5 (45)
    gate = Gate(ex, line_mb=40)
    uids = [gate.add(fp(3, 14)) for _ in range(16)]
    ran = run_all(gate, Scheduler(2048, False, clock=ex.clock))
    started = [a.uid for a in ran if isinstance(a, Start)]
    assert started == uids  # every one, in order
    assert not ex.refused and not any(isinstance(a, Refuse) for a in ran)
    assert gate.most_held == 4  # as many as fit, never more (asserted at each start)
    # four a wave: the head of each later wave waited (those behind it stood in line)
    assert gate.waited == {uids[4], uids[8], uids[12]}


def test_a_large_request_is_not_passed_by_smaller_ones():
    """First come, first served: a request waiting for memory ends the round of starts,
    so the small ones behind it cannot starve it."""
    ex = FakeExecutor()
    gate = Gate(ex, line_mb=30)
    first = gate.add(fp(10, 14))
    big = gate.add(fp(14, 14))  # needs the first to end
    small = gate.add(fp(1, 1))  # would fit beside the first
    sched = Scheduler(2048, False, clock=ex.clock)
    assert [a for a in gate.step(sched) if isinstance(a, Start)] == [Start(first)]
    assert [r.uid for r in ex.queued] == [big, small]
    ran = run_all(gate, sched)
    assert [a.uid for a in ran if isinstance(a, Start)] == [big, small]


def test_refused_only_when_waiting_cannot_help_and_the_next_one_runs():
    ex = FakeExecutor()
    gate = Gate(ex, line_mb=30)
    a = gate.add(fp(3, 14))
    huge = gate.add(fp(20, 14))  # alone over the limit's line
    b = gate.add(fp(3, 14))  # the same size as a: starts after the refusal
    ran = run_all(gate, Scheduler(2048, False, clock=ex.clock))
    assert ex.refused == [Refuse(huge, f"never: {huge}", True)]
    assert [x.uid for x in ran if isinstance(x, Start)] == [a, b]


def test_busy_refusal_when_other_programs_hold_the_memory():
    """The line is below the limit's (other programs fill the machine) and none of ours
    is held to release any: a refusal a later try may pass (not permanent)."""
    ex = FakeExecutor()
    gate = Gate(ex, line_mb=10, limit_line_mb=30)
    uid = gate.add(fp(3, 14))
    ran = run_all(gate, Scheduler(2048, False, clock=ex.clock))
    assert ran == [Refuse(uid, f"busy: {uid}", False)]


@pytest.mark.parametrize("held", [0, 1])
def test_a_request_that_fits_starts_at_once(held):
    ex = FakeExecutor()
    gate = Gate(ex, line_mb=30)
    for _ in range(held + 1):
        gate.add(fp(3, 14))
    ran = gate.step(Scheduler(2048, False, clock=ex.clock))
    assert [a for a in ran if isinstance(a, Start)] == [Start(u) for u in range(1, held + 2)]


def test_a_refusal_crosses_the_rank_wire():
    """Rank 0 decides a refusal; the workers drop the same queued request (§19)."""
    action = Refuse(7, "prompt refused, too large for the memory limit", True)
    assert decode(encode(action)) == action
