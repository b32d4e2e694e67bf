"""Admission by reuse (core/cache/admission.py) on hand-made entries, no model: what is
written at once, deferred, written when reused or evicted, and skipped as covered or
replaced (docs/DESIGN.md §8.6)."""

from __future__ import annotations

from tierchat.core.cache.admission import MOST_WAITS, QUIET_S, WritePolicy, covers, replaced
from tierchat.core.cache.blocks import KIND_BLOCK, KIND_BOUNDARY, KIND_SEQ, KIND_TAIL, Entry

ROOT = "0" * 64


def entry(eid, tokens, kind=KIND_TAIL, role="user", start=0, parent=ROOT, **kw):
    e = Entry(eid.ljust(64, "0"), parent, kind, start, tuple(tokens), role, **kw)
    e.nbytes = 10 * len(tokens)
    return e


def policy(held):
    """A policy whose tiers hold ``held`` (a list it reads at each question)."""
    return WritePolicy(lambda parent: [e for e in held if e.parent == parent])


def test_covers_and_replaced():
    t = entry("a", [1, 2, 3])
    assert covers(entry("b", [1, 2, 3, 4]), t)
    assert not covers(entry("b", [1, 2, 4, 4]), t)
    assert not covers(entry("b", [1, 2, 3, 4], start=16), t)
    assert not covers(entry("b", [1, 2]), t)
    assert not covers(entry("b", [1, 2, 3, 4]), entry("s", [1, 2, 3], snapshot=True))
    old = entry("r1", [1, 2, 3, 7, 7], KIND_SEQ, "assistant", prompt_end=3)
    assert replaced(entry("r2", [1, 2, 3, 8, 8], KIND_SEQ, "assistant"), old)
    assert not replaced(entry("r2", [1, 2, 9, 8, 8], KIND_SEQ), old)  # another prompt
    assert not replaced(entry("r2", [1, 2, 3, 7, 7, 5], KIND_SEQ), old)  # covers it instead


def test_system_blocks_and_checkpoints_now_the_rest_deferred():
    held = []
    w = policy(held)
    assert w.offer(entry("s", range(16), KIND_BLOCK, "system"))
    assert w.offer(entry("c", [1, 2], KIND_BOUNDARY))
    user_block = entry("u", range(16), KIND_BLOCK, "user")
    assert not w.offer(user_block)
    assert w.deferred == 1 and w.deferred_bytes == 160
    assert w.hit(user_block) and w.deferred == 0 and w.admitted["hit"] == 1
    off = WritePolicy(lambda p: [], enabled=False)
    assert off.offer(entry("t", [1, 2, 3]))


def test_close_skips_covered_and_replaced_keeps_the_newest_prompt_tail():
    held = []
    w = policy(held)
    prompt_tail = entry("p1", [1, 2, 3], KIND_TAIL, logprobs=True)
    seq1 = entry("q1", [1, 2, 3, 7], KIND_SEQ, "assistant", prompt_end=3)
    seq2 = entry("q2", [1, 2, 3, 8], KIND_SEQ, "assistant", prompt_end=3)  # a regenerate
    prompt2 = entry("p2", [1, 2, 3, 8, 5], KIND_TAIL, logprobs=True)  # the next turn
    seq3 = entry("q3", [1, 2, 3, 8, 5, 6], KIND_SEQ, "assistant", prompt_end=5)
    for e in (prompt_tail, seq1, seq2, prompt2, seq3):
        held.append(e)
        assert not w.offer(e)
    kept = w.flush()
    # p1 covered by q1, q1 replaced by q2, q2 covered by p2; p2 is the newest prompt tail
    assert [e.id[:2] for e in kept] == ["p2", "q3"]
    assert w.skipped == 3 and w.skipped_bytes == 10 * (3 + 4 + 4)
    assert w.deferred == 0


def test_an_evicted_leaf_is_written_a_covered_one_skipped():
    held = []
    w = policy(held)
    a = entry("a", [1, 2, 3], KIND_SEQ, "assistant", prompt_end=2)
    b = entry("b", [1, 2, 3, 4, 5], KIND_SEQ, "assistant", prompt_end=4)
    for e in (a, b):
        held.append(e)
        w.offer(e)
    held.remove(a)
    assert not w.evicted(a)  # b holds its tokens
    held.remove(b)
    assert w.evicted(b) and w.admitted["evicted"] == 1
    assert not w.evicted(b)  # not deferred any more: nothing to do


class Clock:
    """An injected clock (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_deferred_entries_are_due_after_the_window_covered_ones_skipped():
    """docs/DESIGN.md §8.6: an entry deferred waits ``idle_s`` from its commit, then is
    written or skipped as covered, as at close: a session that goes on within the window
    covers its last turn's tails; one that stops is written ``idle_s`` later."""
    held = []
    clock = Clock()
    w = WritePolicy(lambda parent: [e for e in held if e.parent == parent], idle_s=5.0)
    w.clock = clock
    assert w.due_in() is None and w.due() == []
    block = entry("b", range(16), KIND_BLOCK, "user")
    tail1 = entry("p1", [1, 2, 3], KIND_TAIL, logprobs=True)
    seq1 = entry("q1", [1, 2, 3, 7], KIND_SEQ, "assistant", prompt_end=3)
    for e in (block, tail1, seq1):
        held.append(e)
        assert not w.offer(e)
    assert w.due_in() == 5.0
    clock.now += 3.0  # the next turn comes within the window
    tail2 = entry("p2", [1, 2, 3, 7, 9], KIND_TAIL, logprobs=True)
    seq2 = entry("q2", [1, 2, 3, 7, 9, 4], KIND_SEQ, "assistant", prompt_end=5)
    for e in (tail2, seq2):
        held.append(e)
        assert not w.offer(e)
    assert w.due_in() == 2.0 and w.due() == []
    clock.now += 2.0
    # the first turn's entries are due: the block is written, its tails are covered
    assert [e.id[:2] for e in w.due()] == ["b0"]
    assert w.skipped == 2 and w.admitted["idle"] == 1 and w.deferred == 2
    assert w.due_in() == 3.0
    clock.now += 3.0  # the session stopped: its last turn is written
    assert [e.id[:2] for e in w.due()] == ["p2", "q2"]
    assert w.deferred == 0 and w.due_in() is None and w.flush() == []


def test_due_is_bounded_in_bytes_and_a_reuse_is_written_at_once():
    clock = Clock()
    w = WritePolicy(lambda parent: [], idle_s=0.0)
    w.clock = clock
    blocks = [
        entry(f"b{i}", range(i * 16, i * 16 + 16), KIND_BLOCK, start=16 * i) for i in range(5)
    ]
    for b in blocks:
        w.offer(b)
    assert w.due_in() == 0.0
    assert w.hit(blocks[0]) and w.admitted["hit"] == 1  # reused: written now, not due later
    first = w.due(max_bytes=2 * 160)
    assert [e.id[:2] for e in first] == ["b1", "b2"]
    assert [e.id[:2] for e in w.due(max_bytes=1)] == ["b3"]  # at least one
    assert [e.id[:2] for e in w.due()] == ["b4"] and w.due_in() is None


def test_a_due_entry_waits_for_a_quiet_engine_but_never_past_most_waits():
    """docs/DESIGN.md §8.6: past its window an entry is due only once no request has been
    held or waiting for QUIET_S (clients sending their next turn as a reply ends leave
    the engine idle for milliseconds: a write started there slows their prefills), and
    under a load that never pauses, after MOST_WAITS windows whatever the quiet."""
    clock = Clock()
    w = WritePolicy(lambda parent: [], idle_s=5.0)
    w.clock = clock
    b = entry("b", range(16), KIND_BLOCK, "user")
    w.offer(b)
    clock.now += 5.0  # the window is over, but a request ended just now
    assert w.due(quiet_for=0.0) == [] and w.due_in(quiet_for=0.0) == QUIET_S
    assert w.due(quiet_for=QUIET_S / 2) == []
    assert w.due_in(quiet_for=QUIET_S / 2) == QUIET_S / 2
    assert [e.id[:2] for e in w.due(quiet_for=QUIET_S)] == ["b0"]
    # constant load: due at MOST_WAITS windows with no quiet at all
    c = entry("c", range(16, 32), KIND_BLOCK, "user", start=16)
    w.offer(c)
    clock.now += MOST_WAITS * 5.0 - 0.5
    assert w.due(quiet_for=0.0) == [] and w.due_in(quiet_for=0.0) == 0.5
    clock.now += 0.5
    assert [e.id[:2] for e in w.due(quiet_for=0.0)] == ["c0"]
