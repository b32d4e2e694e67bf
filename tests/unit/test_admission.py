"""Admission by reuse (core/cache/admission.py) on hand-made entries, no model: what is
written at once, deferred, written when reused or evicted, and skipped as covered or
replaced (docs/DESIGN.md §8.6)."""

from __future__ import annotations

from tierchat.core.cache.admission import WritePolicy, covers, replaced
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
