"""Every counter of the stats snapshot moves when it should (docs/DESIGN.md §10)."""

from __future__ import annotations

import dataclasses

import pytest
from engine_kit import engine_maker, generate, random_prompt
from tierchat.core.api import CacheStats
from tierchat.core.sampling_params import SamplingParams


@pytest.fixture
def engine(tmp_path, models_dir):
    with engine_maker(tmp_path, models_dir) as make:
        yield make


def test_snapshot_is_immutable(engine):
    s = engine().stats()
    assert isinstance(s, CacheStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.model = "x"  # type: ignore[misc]
    assert s.supported is True and s.enabled is True
    assert s.layer_kinds and all(":kv" in k for k in s.layer_kinds)


def test_hot_and_ssd_counters(engine):
    e = engine()
    p = random_prompt(100, seed=1)
    generate(e, p)
    e.cache.ssd.flush()
    s = e.stats()
    assert s.hot.entries > 0 and s.hot.nbytes > 0 and s.hot.max_bytes == 256 << 20
    assert s.hot.misses == 6  # 99 // 16 blocks looked up, none held
    assert s.ssd.misses == 6
    # admission (docs/DESIGN.md §8.6): nothing of a first turn is written until it is
    # read again, evicted or closed; the hot tier holds it meanwhile
    assert s.ssd.saves_queued == s.ssd.saves_persisted == s.ssd.entries == 0
    assert s.wear.deferred == s.hot.entries > 0 and s.wear.deferred_bytes == s.hot.nbytes
    assert s.hot.hits == 0 and s.ssd.hits == 0
    assert s.last_turn.prompt_tokens == 100 and s.last_turn.cached_tokens == 0

    assert s.resident.tokens == 100 + 8 and s.resident.nbytes > 0 and s.resident.hits == 0

    # the same prompt again: the resident cache is cut back in place to the whole prompt
    # and the first token comes from its kept logprobs
    generate(e, p)
    s1 = e.stats()
    assert s1.resident.hits == 1 and s1.hot.hits == 0
    assert s1.last_turn.cached_kind["resident"] == 100 and s1.last_turn.cached_by["hot"] == 100
    assert s1.last_turn.prefill_tokens == 0
    assert any("first token from its kept logprobs" in text for _, text in s1.events)

    e.clear("resident")  # from the hot tier's entries now
    generate(e, p)
    s2 = e.stats()
    assert s2.hot.hits == 7 and s2.last_turn.cached_tokens == 99  # 6 blocks + the tail
    assert s2.last_turn.cached_by["hot"] == 99 and s2.last_turn.cached_kind["tail"] == 3
    assert any("hit 99 tokens" in text for _, text in s2.events)

    e.clear("hot")  # what RAM held and the SSD tier did not is written first
    e.cache.ssd.flush()
    s3 = e.stats()
    assert s3.hot.entries == 0 and s3.hot.nbytes == 0 and s3.wear.deferred == 0
    assert s3.ssd.saves_queued == s3.ssd.saves_persisted == s3.ssd.entries > 0
    assert s3.ssd.nbytes > 0 and s3.ssd.queue_depth == 0
    assert s3.wear.session_bytes == s3.ssd.nbytes
    assert any("cleared hot" in text for _, text in s3.events)
    generate(e, p)
    s4 = e.stats()
    assert s4.ssd.hits > s3.ssd.hits and s4.last_turn.cached_by["ssd"] == 99

    e.clear("ssd")
    assert e.stats().ssd.entries == 0 and e.stats().ssd.nbytes == 0


def test_evictions_under_small_budgets(engine):
    e = engine(hot_bytes=60_000, ssd_bytes=120_000)
    for seed in range(4):
        generate(e, random_prompt(120, seed=seed), max_tokens=2)
    e.cache.ssd.flush()
    s = e.stats()
    assert s.hot.evictions > 0 and s.hot.nbytes <= 60_000
    assert s.ssd.evictions > 0 and s.ssd.nbytes <= 120_000


def test_tail_counters(engine):
    e = engine(tail_entries=2)
    p = random_prompt(70, seed=5)
    generate(e, p)
    s = e.stats()
    assert s.tails.stashes >= 2 and s.tails.entries == 2 and s.tails.max_entries == 2
    assert s.tails.supported is True and s.tails.nbytes > 0
    e.clear("resident")
    r, _ = generate(e, p)
    s2 = e.stats()
    assert s2.tails.hits == s.tails.hits + 1
    assert s2.tails.tokens_saved == s.tails.tokens_saved + r.metrics.cached_kind["tail"] > 0
    for seed in range(3):
        generate(e, random_prompt(70, seed=50 + seed), max_tokens=2)
    assert e.stats().tails.evictions > 0
    assert e.stats().tails.misses > 0
    e.clear("tails")
    assert e.stats().tails.entries == 0


def test_checkpoint_and_snapshot_counters(engine):
    e = engine("tiny:qwen3_next")
    p = random_prompt(70, seed=7)
    first, _ = generate(e, p, max_tokens=4)
    s = e.stats()
    assert s.snapshots.count > 0 and s.snapshots.nbytes > 0
    assert any(k.endswith(":state") for k in s.layer_kinds)
    # continue after the stored prompt + reply: served by the sequence-end checkpoint
    cont = p + first.token_ids + random_prompt(10, seed=8)
    e.clear("resident")
    r, _ = generate(e, cont, max_tokens=2)
    assert r.metrics.cached_kind["checkpoint"] > 0
    assert e.stats().tails.checkpoint_hits == 1


def test_boundary_checkpoints_stored_for_state_models(engine):
    from tierchat.core.api import GenerateRequest

    e = engine("tiny:mamba2")
    p = random_prompt(60, seed=9)
    h = e.submit(
        GenerateRequest(
            sampling=SamplingParams(max_tokens=2),
            prompt_ids=p,
            boundaries=((21, "system"), (45, "user")),
        )
    )
    h.wait(60)
    assert e.stats().tails.checkpoints == 3  # two boundaries and the sequence end
    # an edit after the system prompt restores from its checkpoint
    edited = p[:30] + random_prompt(30, seed=10)
    e.clear("resident")
    r, _ = generate(e, edited, max_tokens=2)
    assert r.metrics.cached_tokens == 21 and r.metrics.cached_kind["checkpoint"] == 21 - 16


def test_unsupported_model_reports_and_runs_cold(engine, monkeypatch):
    import tierchat.core.cache.layers as layers

    def refuse(caches):
        raise layers.UnsupportedCache("layer 0: cache class FancyCache is not supported")

    monkeypatch.setattr(layers, "classify", refuse)
    e = engine()
    s = e.stats()
    assert s.supported is False and "FancyCache" in s.reason and s.enabled is False
    r, _ = generate(e, random_prompt(40), max_tokens=2)
    assert r.metrics.cached_tokens == 0
    r2, _ = generate(e, random_prompt(40), max_tokens=2)
    assert r2.metrics.cached_tokens == 0


def test_failed_model_load_keeps_the_current_model_and_cache(engine):
    from tierchat.core.api import Failed

    e = engine()
    generate(e, random_prompt(40), max_tokens=2)
    before = e.stats()
    res = e.load_model("no-such-model-anywhere").wait(60)
    assert isinstance(res, Failed) and res.kind == "load"
    after = e.stats()
    assert after.model == before.model and after.enabled and after.supported is True
    assert after.hot.entries == before.hot.entries
    r, _ = generate(e, random_prompt(40), max_tokens=2)
    assert r.metrics.cached_tokens == 40  # the resident cache survived, kept logprobs too


def test_lookups_count_one_per_turn_and_checkpoints_agree_with_turn_labels(engine):
    """One count per turn by where its prefix came from; a cold turn is a logged miss;
    a turn labelled "checkpoint" (a sequence end) finds the checkpoint counted as held."""
    e = engine()
    p = random_prompt(60, seed=5)
    first, _ = generate(e, p)
    s = e.stats()
    assert (s.lookups.cold, s.lookups.hits) == (1, 0)
    assert any(text.startswith("miss: nothing cached for 60 tokens") for _, text in s.events)

    generate(e, p)  # the resident cache
    assert e.stats().lookups.resident == 1

    e.clear("resident")  # the next turn continues at the sequence end entry
    nxt = p + tuple(first.token_ids) + random_prompt(5, seed=6)
    out, _ = generate(e, nxt)
    s = e.stats()
    assert out.metrics.cached_kind["checkpoint"] > 0, out.metrics
    assert s.tails.checkpoints >= 1 and s.tails.checkpoint_hits == 1
    assert s.lookups.hot == 1 and s.lookups.tail == 1
    assert (s.lookups.hits, s.lookups.lookups, s.lookups.hit_rate) == (2, 3, 2 / 3)


def test_an_automatic_ssd_cap_is_sized_from_the_model(engine):
    """``ssd_bytes`` auto (None): the tier's cap is :func:`auto_ssd_bytes` of the loaded
    model's whole-context K/V and the disk; a number given is the cap as it is."""
    from tierchat.core.engine.runtime import auto_ssd_bytes, context_length, free_disk_bytes

    e = engine(ssd_bytes=None)
    rt = e.runtime
    want = auto_ssd_bytes(
        rt.kv_profile.nbytes(context_length(rt.loaded.model) or 0),
        free_disk_bytes(e.settings.cache_dir),
    )
    assert e.stats().ssd.max_bytes == want >= 16 << 30
    assert engine(ssd_bytes=3 << 20).stats().ssd.max_bytes == 3 << 20
