"""SSD writes counted, budgeted and admitted by reuse (docs/DESIGN.md §8.6).

On ``tiny:llama`` (folded schedule, blocks of 16 tokens): the write ledger's counters equal
the bytes of the files on disk; a write budget is never exceeded, across a restart too;
admission defers a conversation's tails and blocks until reuse, eviction or close and
skips the covered ones; after a restart the system prompt and the last conversation are
restored from the SSD tier, the last prompt with no forward at all.
"""

from __future__ import annotations

import json

import pytest
from engine_kit import generate, make_engine, random_prompt
from tierchat.core.api import GenerateRequest, TokenBatch
from tierchat.core.cache.admission import covers
from tierchat.core.cache.blocks import KIND_BLOCK, KIND_TAIL
from tierchat.core.sampling_params import SamplingParams

MODEL = "tiny:llama"
SYSTEM = random_prompt(40, seed=21)  # 2 system blocks and 8 tokens of a third
N_SYS = len(SYSTEM)


def turn(engine, prompt, max_tokens=6):
    result, _ = generate(engine, prompt, max_tokens, boundaries=((N_SYS, "system"),))
    return result


def conversation(engine, seed, turns=3):
    """A conversation after the shared system prompt: ``turns`` user turns, each
    continuing the last prompt and reply. Returns (last prompt, last sequence)."""
    prompt = SYSTEM + random_prompt(9, seed=seed)
    for k in range(turns):
        r = turn(engine, prompt)
        seq = prompt + r.token_ids
        if k < turns - 1:
            prompt = seq + random_prompt(7, seed=seed * 10 + k)
    return prompt, seq


def files(tmp_path):
    return sorted(p for p in (tmp_path / "kv").rglob("*.safetensors") if p.is_file())


def engine(tmp_path, models_dir, **kw):
    return make_engine(MODEL, tmp_path, models_dir, bitwise=False, **kw)


def test_counters_equal_the_bytes_on_disk(tmp_path, models_dir):
    e = engine(tmp_path, models_dir)
    conversation(e, 1)
    conversation(e, 2, turns=2)
    assert e.cache.ssd.flush()
    w = e.stats().wear
    on_disk = files(tmp_path)
    assert w.session_files == len(on_disk) > 0
    assert w.session_bytes == w.total_bytes == sum(p.stat().st_size for p in on_disk)
    e.close()
    on_disk = files(tmp_path)
    ledger = json.loads((tmp_path / "kv" / "ssd-writes.json").read_text())
    assert ledger["total_files"] == len(on_disk)
    assert ledger["total_bytes"] == sum(p.stat().st_size for p in on_disk)
    # the next session starts its own count and keeps the total
    e = engine(tmp_path, models_dir)
    try:
        w = e.stats().wear
        assert (w.session_bytes, w.total_bytes) == (0, ledger["total_bytes"])
        assert w.day_bytes == ledger["total_bytes"]
    finally:
        e.close()


def test_turns_defer_until_reuse_and_skip_covered_entries(tmp_path, models_dir):
    e = engine(tmp_path, models_dir)
    try:
        conversation(e, 1)
        assert e.cache.ssd.flush()
        held = [e.cache.ssd.meta(i) for i in list(e.cache.ssd._index)]
        # written at once: the system prompt's blocks, nothing of the conversation yet
        assert held and all(m.kind == KIND_BLOCK and m.role == "system" for m in held)
        assert e.stats().wear.deferred > 0
        # a turn's ssd_write_bytes counts only what it handed to the writer
        r = turn(e, SYSTEM + random_prompt(9, seed=5))
        assert r.metrics.ssd_write_bytes == 0  # nothing new of the system prompt to write
    finally:
        e.close()
    w_skipped = None
    e = engine(tmp_path, models_dir)
    try:
        w_skipped = e.cache.ssd.ledger.total_files
        tails = [m for m in map(e.cache.ssd.meta, list(e.cache.ssd._index)) if m.kind != KIND_BLOCK]
        covered = [t for t in tails if any(covers(c, t) for c in e.cache.ssd.children_of(t.parent))]
        # only the newest prompt tail (kept logprobs) may be covered by another file
        assert len(covered) <= 1
        assert all(t.kind == KIND_TAIL and t.logprobs for t in covered)
    finally:
        e.close()
    assert w_skipped > 0


def test_skipped_entries_are_counted(tmp_path, models_dir):
    e = engine(tmp_path, models_dir)
    conversation(e, 1, turns=4)
    e.close()  # the cache's close judges the deferred entries
    w = e.cache.wear_stats()
    assert w.skipped > 0 and w.skipped_bytes > 0
    assert w.deferred == 0


def test_a_restart_restores_the_system_prompt_and_the_last_conversation(tmp_path, models_dir):
    e = engine(tmp_path, models_dir)
    conversation(e, 1)
    last_prompt, last_seq = conversation(e, 2)
    e.close()
    e = engine(tmp_path, models_dir)
    try:
        # the last conversation continues from the SSD tier: every token of its sequence
        r = turn(e, last_seq + random_prompt(5, seed=99))
        assert r.metrics.cached_tokens == len(last_seq)
        assert r.metrics.cached_by["ssd"] == len(last_seq)
    finally:
        e.close()
    e = engine(tmp_path, models_dir)
    try:
        # the last prompt again: all of it, the first token from the kept logprobs
        r = turn(e, last_prompt)
        assert r.metrics.cached_tokens == len(last_prompt)
        assert r.metrics.prefill_tokens == 0
        # a new conversation: the system prompt comes from the SSD tier
        r = turn(e, SYSTEM + random_prompt(9, seed=77))
        assert r.metrics.cached_tokens >= N_SYS
    finally:
        e.close()


def test_a_conversation_returned_to_is_written(tmp_path, models_dir):
    e = engine(tmp_path, models_dir)
    try:
        _, seq_a = conversation(e, 1, turns=2)
        conversation(e, 2, turns=1)  # the resident cache goes to another conversation
        assert e.cache.writes.admitted["hit"] == 0
        r = turn(e, seq_a + random_prompt(5, seed=42))  # back to the first one
        assert r.metrics.cached_by["hot"] == len(seq_a)
        assert e.cache.writes.admitted["hit"] > 0
        assert e.cache.ssd.flush()
        ids = e.cache.ids(seq_a)
        assert all(i in e.cache.ssd for i in ids)  # its blocks are on disk now
    finally:
        e.close()


@pytest.mark.parametrize("budget_files", [2, 4])
def test_the_write_budget_is_respected(tmp_path, models_dir, budget_files):
    # one block's file of tiny:llama is a few KiB: a budget of a few files' bytes
    probe = engine(tmp_path / "probe", models_dir)
    conversation(probe, 1, turns=1)
    probe.close()
    sizes = sorted(p.stat().st_size for p in files(tmp_path / "probe"))
    budget = sum(sizes[-budget_files:])
    e = engine(tmp_path, models_dir, ssd_write_budget=budget)
    conversation(e, 1)
    conversation(e, 2)
    e.close()
    on_disk = sum(p.stat().st_size for p in files(tmp_path))
    assert 0 < on_disk <= budget
    e = engine(tmp_path, models_dir, ssd_write_budget=budget)
    w = e.stats().wear
    assert w.day_bytes == on_disk <= w.budget_bytes == budget
    conversation(e, 3)
    e.close()
    w = e.cache.wear_stats()
    assert w.budget_skips > 0 and w.budget_skipped_bytes > 0
    assert w.day_bytes <= budget
    assert sum(p.stat().st_size for p in files(tmp_path)) <= budget


@pytest.mark.parametrize("while_busy", [False, True])
def test_writes_wait_for_no_request_held_unless_told(tmp_path, models_dir, while_busy):
    """``ssd_write_while_busy`` off (auto on CUDA): every decode step of a request finds
    the SSD writer held, and the writes land once no request is held; on: held only
    before the first token. Observed on the engine thread (the event callback), so the
    check is exact under load. The replies are the same either way."""
    e = engine(tmp_path, models_dir, ssd_write_while_busy=while_busy, ssd_admission=False)
    held: list[bool] = []

    def on_event(event):
        if isinstance(event, TokenBatch) and event.token_ids:
            held.append(e.cache.ssd.held)

    prompt = SYSTEM + random_prompt(20, seed=5)
    first = e.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=8), prompt_ids=prompt), on_event
    ).wait(120)
    assert len(held) == 8
    # the first token comes while the request's own hold is given up
    assert held[1:] == [not while_busy] * 7
    assert e.cache.ssd.flush(60)
    assert not e.cache.ssd.held
    assert e.stats().wear.session_files > 0  # written once the request ended
    again = turn(e, prompt, max_tokens=8)
    assert again.token_ids == first.token_ids
    e.close()
