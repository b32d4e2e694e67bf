"""Kept logprobs persisted with prompt tails (folded schedule, docs/DESIGN.md §8.3).

A prompt tail captured at ``N`` keeps the first reply token's logprobs, in the hot tier
and in its SSD file: the same prompt again restores all ``N`` tokens through it and
samples the first token from them, no forward, after a restart or once the resident cache
went to another prompt. Every path equals a cold run; a damaged file is never used.
"""

from __future__ import annotations

import pytest
from engine_kit import assert_same, generate, make_engine, random_prompt
from tierchat.core.cache.blocks import (
    KIND_BLOCK,
    KIND_TAIL,
    LOGPROBS,
    EntryMeta,
    chain_ids,
    root_id,
    tail_id,
)
from tierchat.core.cache.ssd.format import CorruptEntry, _meta_strings, entry_meta
from tierchat.core.cache.ssd.io import read_file
from tierchat.core.cache.ssd.tier import SSDTier

BS = 16
PROMPT = random_prompt(45, seed=11)  # 2 blocks and a 13-token tail
OTHER = random_prompt(40, seed=12)


def cold_run(model, tmp_path, models_dir, prompt=PROMPT):
    e = make_engine(model, tmp_path / "cold", models_dir, no_cache=True, bitwise=False)
    try:
        return generate(e, prompt)
    finally:
        e.close()


def tail_path(engine, prompt=PROMPT):
    j = len(prompt) // BS
    parent = engine.cache.ids(prompt)[j - 1] if j else engine.cache.root
    return engine.cache.ssd._path(tail_id(parent, prompt[j * BS :]))


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
def test_same_prompt_after_restart_prefills_nothing(tmp_path, models_dir, arch):
    model = f"tiny:{arch}"
    cold = cold_run(model, tmp_path, models_dir)
    e = make_engine(model, tmp_path, models_dir, bitwise=False)
    first, handle = generate(e, PROMPT)
    assert_same(*cold, first, handle)
    path = tail_path(e)
    e.close()
    layout = read_file(path)[0]
    assert layout.meta["logprobs"] == "1"
    assert any(name == LOGPROBS for name, *_ in layout.tensors)

    e = make_engine(model, tmp_path, models_dir, bitwise=False)
    try:
        again, handle = generate(e, PROMPT)
        assert_same(*cold, again, handle)
        m = again.metrics
        assert m.prefill_tokens == 0 and m.cached_tokens == len(PROMPT), m
        assert m.cached_by["ssd"] == len(PROMPT), m
        assert m.cached_kind["tail"] == len(PROMPT) % BS, m
        assert e.stats().ssd.corrupt == 0
    finally:
        e.close()


def test_older_prompt_from_the_hot_tier_prefills_nothing(tmp_path, models_dir):
    """Prompt A, prompt B (the resident cache is B's now), A again: A's tail in the hot
    tier gives the whole prompt and its first token."""
    model = "tiny:llama"
    cold = cold_run(model, tmp_path, models_dir)
    e = make_engine(model, tmp_path, models_dir, bitwise=False)
    try:
        generate(e, PROMPT)
        generate(e, OTHER)
        again, handle = generate(e, PROMPT)
        assert_same(*cold, again, handle)
        m = again.metrics
        assert m.prefill_tokens == 0, m
        assert m.cached_by["hot"] == len(PROMPT) and m.cached_by["ssd"] == 0, m
        assert m.cached_kind["tail"] == len(PROMPT) % BS, m
        assert m.cached_kind["block"] == len(PROMPT) // BS * BS, m
    finally:
        e.close()


def test_prompt_inside_a_longer_resident_takes_only_the_logprobs(tmp_path, models_dir):
    """A longer prompt that continues A is resident (a swipe back to an earlier message):
    the resident cache is cut back to all of A, and the first token comes from the
    logprobs A's tail kept."""
    model = "tiny:llama"
    cold = cold_run(model, tmp_path, models_dir)
    e = make_engine(model, tmp_path, models_dir, bitwise=False)
    try:
        generate(e, PROMPT)
        generate(e, PROMPT + OTHER[:7])
        again, handle = generate(e, PROMPT)
        assert_same(*cold, again, handle)
        m = again.metrics
        assert m.prefill_tokens == 0 and m.cached_kind["resident"] == len(PROMPT), m
    finally:
        e.close()


def test_state_model_still_prefills_one_token_after_restart(tmp_path, models_dir):
    model = "tiny:qwen3_5"
    cold = cold_run(model, tmp_path, models_dir)
    e = make_engine(model, tmp_path, models_dir, bitwise=False)
    generate(e, PROMPT)
    e.close()
    e = make_engine(model, tmp_path, models_dir, bitwise=False)
    try:
        assert len(e.cache.ssd) and not any(m.logprobs for m in e.cache.ssd._index.values())
        again, handle = generate(e, PROMPT)
        assert_same(*cold, again, handle)
        assert again.metrics.prefill_tokens == 1, again.metrics
    finally:
        e.close()


def test_bitwise_schedule_keeps_no_logprobs(tmp_path, models_dir):
    """The bitwise schedule's tail ends at N - 1 and keeps nothing: a restart prefills the
    last token as before."""
    model = "tiny:llama"
    e = make_engine(model, tmp_path, models_dir)
    generate(e, PROMPT)
    e.close()
    e = make_engine(model, tmp_path, models_dir)
    try:
        again, _ = generate(e, PROMPT)
        assert again.metrics.prefill_tokens == 1, again.metrics
        assert not any(m.logprobs for m in e.cache.ssd._index.values())
    finally:
        e.close()


def test_corrupt_logprobs_in_a_file_are_never_used(tmp_path, models_dir, monkeypatch):
    """One byte of the kept logprobs changed on disk: the data checksum fails at the load,
    the entry is counted corrupt and evicted, and the restore falls back below the whole
    prompt (at least its last token is prefilled); the turn equals a cold run."""
    model = "tiny:llama"
    cold = cold_run(model, tmp_path, models_dir)
    e = make_engine(model, tmp_path, models_dir, bitwise=False)
    generate(e, PROMPT)
    path = tail_path(e)
    e.close()
    layout = read_file(path)[0]
    begin = next(b for name, _, _, b, _ in layout.tensors if name == LOGPROBS)
    data = bytearray(path.read_bytes())
    data[layout.data_start + begin + 5] ^= 0x40
    path.write_bytes(bytes(data))

    monkeypatch.setattr(SSDTier, "verify_at_start", False)  # the load path must catch it
    e = make_engine(model, tmp_path, models_dir, bitwise=False)
    try:
        meta = e.cache.ssd.meta(path.stem)
        assert meta is not None and meta.logprobs and meta.kind == KIND_TAIL
        again, handle = generate(e, PROMPT)
        assert_same(*cold, again, handle)
        m = again.metrics
        assert e.stats().ssd.corrupt == 1
        # the restore fell back below N (the sequence end's entry still gives N - 1)
        assert m.prefill_tokens >= 1 and m.cached_kind["tail"] == 0, m
    finally:
        e.close()
    # the tail is captured again, healthy, and written at the close (the newest prompt
    # tail: docs/DESIGN.md §8.6)
    assert read_file(path)[0].meta["logprobs"] == "1"


def test_header_flag_round_trips_and_older_headers_read_without_it():
    """The ``logprobs`` header field is written only where set; a header without it (files
    written before) reads as an entry without kept logprobs; a block claiming them is
    corrupt (only a prompt tail ends at a prompt's end)."""
    fp = "ab" * 32
    root = root_id(fp)
    tokens = (5, 6, 7)
    kept = EntryMeta(tail_id(root, tokens), root, KIND_TAIL, 0, tokens, "user", logprobs=True)
    strings = _meta_strings(kept, fp)
    assert strings["logprobs"] == "1" and entry_meta(strings, fp) == kept
    older = {k: v for k, v in strings.items() if k != "logprobs"}
    assert entry_meta(older, fp).logprobs is False
    plain = EntryMeta(tail_id(root, tokens), root, KIND_TAIL, 0, tokens, "user")
    assert "logprobs" not in _meta_strings(plain, fp)
    block_id = chain_ids(root, tokens, len(tokens), 1)[0]
    block = EntryMeta(block_id, root, KIND_BLOCK, 0, tokens, "user", logprobs=True)
    with pytest.raises(CorruptEntry, match="kept logprobs"):
        entry_meta(_meta_strings(block, fp), fp)


def test_restore_or_recompute_choice_still_holds_for_the_whole_prompt(tmp_path, models_dir):
    """After a restart the kept tail's plan (N tokens, 0 prefilled) goes through the
    restore-or-recompute choice (core/cache/rates.py) like any SSD plan: read when the
    disk is estimated fast, computed again when it is (made) slow; equal to cold both ways."""
    import json

    prompt = random_prompt(690, seed=31)  # 10 blocks of 64 and a 50-token tail
    model = "tiny:llama"
    cold = cold_run(model, tmp_path, models_dir, prompt)
    e = make_engine(model, tmp_path, models_dir, bitwise=False, block_size=64)
    generate(e, prompt, max_tokens=3)  # a 690-token prefill: a measured rate
    e.close()
    (path,) = (tmp_path / "kv").glob("rates-*.json")
    rates = json.loads(path.read_text())
    assert rates["prefill_tps"] > 0
    for read_bps, taken in ((1e15, "ssd "), (1.0, "recompute ")):
        path.write_text(json.dumps({**rates, "read_bps": read_bps}))
        e = make_engine(model, tmp_path, models_dir, bitwise=False, block_size=64)
        try:
            out, handle = generate(e, prompt)
            assert_same(*cold, out, handle)
            m = out.metrics
            assert m.restore_choice.startswith(taken), m
            if taken == "ssd ":
                assert m.prefill_tokens == 0 and m.cached_by["ssd"] == len(prompt), m
            else:
                assert m.cached_tokens == 0 and m.prefill_tokens == len(prompt), m
        finally:
            e.close()


def test_resident_with_logprobs_from_an_ssd_tail_is_labelled_hot_resident(tmp_path, models_dir):
    """The resident cache (RAM) cut back to A, A's kept logprobs read from its SSD tail
    only: the tokens count for the hot tier, kind resident; the log names the SSD tail
    as the first token's source. An "SSD resident" label said the K/V came from disk."""
    model = "tiny:llama"
    cold = cold_run(model, tmp_path, models_dir)
    # write-through: the test takes the tail out of RAM itself, not through an eviction
    e = make_engine(model, tmp_path, models_dir, bitwise=False, ssd_admission=False)
    try:
        generate(e, PROMPT)
        generate(e, PROMPT + OTHER[:7])
        e.call(lambda: e.cache.ssd.flush(), timeout=60)
        j = len(PROMPT) // BS
        tid = tail_id(e.cache.ids(PROMPT)[j - 1], PROMPT[j * BS :])
        e.call(lambda: e.cache.hot.remove(tid), timeout=60)
        again, handle = generate(e, PROMPT)
        assert_same(*cold, again, handle)
        m = again.metrics
        assert m.prefill_tokens == 0 and m.cached_kind["resident"] == len(PROMPT), m
        assert m.cached_by["hot"] == len(PROMPT) and m.cached_by["ssd"] == 0, m
        events = [text for _, text in e.stats().events]
        assert any("from the ssd tail's kept logprobs" in t for t in events), events[-5:]
    finally:
        e.close()
