"""The engine under memory limits: refusals instead of OOM, budgets that shrink and recover."""

from __future__ import annotations

from engine_kit import assert_same, generate, make_engine, random_prompt
from tierchat.core.api import Failed, GenerateRequest
from tierchat.core.memory import prefill as prefill_mod
from tierchat.core.sampling_params import SamplingParams


def test_refusal_leaves_every_tier_usable(tmp_path, models_dir):
    prompt = random_prompt(100, seed=4)
    e = make_engine("tiny:llama", tmp_path, models_dir)
    first, h1 = generate(e, prompt)
    e.close()  # admission by reuse writes the rest of the turn at close

    tight = make_engine("tiny:llama", tmp_path, models_dir, memory_limit=1 << 20)
    before = tight.stats().ssd.entries
    assert before > 0
    long_prompt = random_prompt(3000, seed=5)
    res = tight.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=4), prompt_ids=long_prompt)
    ).wait(60)
    assert isinstance(res, Failed) and res.kind == "refused"
    for word in ("prompt refused", "memory limit", "--memory-limit"):
        assert word in res.message
    assert tight.stats().ssd.entries == before  # nothing lost
    tight.close()

    again = make_engine("tiny:llama", tmp_path, models_dir)
    r, h2 = generate(again, prompt)
    assert_same(first, h1, r, h2)
    assert r.metrics.cached_by["ssd"] == 99 and r.metrics.cached_kind["block"] == 96
    again.close()


def test_smaller_chunks_before_refusing(tmp_path, models_dir, monkeypatch):
    e = make_engine("tiny:llama", tmp_path, models_dir, block_size=64)
    seen = []
    real = prefill_mod.plan_prefill

    def spy(estimate, limit, chunk_tokens, **kw):
        # pretend the limit sits between the 16- and 32-token chunk estimates
        limit = (estimate(16) + estimate(32)) // 2
        out = real(estimate, limit, chunk_tokens, **kw)
        seen.append(out[0])
        return out

    monkeypatch.setattr(prefill_mod, "plan_prefill", spy)
    cold = make_engine("tiny:llama", tmp_path / "cold", models_dir, block_size=64, no_cache=True)
    prompt = random_prompt(200, seed=6)
    a, ha = generate(cold, prompt)
    b, hb = generate(e, prompt)
    assert seen[-1] == 16
    assert_same(a, ha, b, hb)  # smaller chunks, same tokens
    assert e.stats().hot.entries >= 3  # block ends are still chunk ends
    e.close()
    cold.close()


def test_soft_pressure_shrinks_hot_budget_then_restores(tmp_path, models_dir, monkeypatch):
    e = make_engine("tiny:llama", tmp_path, models_dir)
    for seed in range(3):
        generate(e, random_prompt(120, seed=seed), max_tokens=2)
    held = e.stats().hot.nbytes
    configured = e.settings.hot_bytes
    monkeypatch.setattr(
        e.monitor, "budget", lambda c, held_bytes, min_bytes=0, leaving_bytes=0: held // 3
    )
    monkeypatch.setattr(e.monitor, "level", lambda reading=None: "soft")
    generate(e, random_prompt(40, seed=9), max_tokens=2)
    s = e.stats()
    assert s.hot.max_bytes == held // 3 and s.hot.nbytes <= held // 3 and s.hot.evictions > 0
    assert any("memory soft" in t for _, t in s.events)
    monkeypatch.setattr(e.monitor, "budget", lambda c, held_bytes, min_bytes=0, leaving_bytes=0: c)
    generate(e, random_prompt(40, seed=9), max_tokens=2)
    assert e.stats().hot.max_bytes == configured
    e.close()


def test_mlx_pool_goes_back_before_the_hot_tier_shrinks(tmp_path, models_dir, monkeypatch):
    """Freed buffers in MLX's pool count as memory in use; past the hard line only because
    of them, the engine gives them back (``mx.clear_cache``) and the hot tier keeps all it
    holds (before, the budget was read with the pool in it: 0 bytes, everything evicted)."""
    import mlx.core as mx
    from tierchat.core.memory.readings import MemoryReading

    e = make_engine("tiny:llama", tmp_path, models_dir)
    try:
        for seed in range(3):
            generate(e, random_prompt(120, seed=seed), max_tokens=2)
        before = e.stats().hot
        gib = 1 << 30
        pool = {"bytes": 9 * gib}  # 1 GiB live + 9 GiB pool of a 10 GiB limit: hard

        class Reader:
            def read(self) -> MemoryReading:
                return MemoryReading(active=gib, peak=gib, cache=pool["bytes"])

        real_clear = mx.clear_cache

        def clear() -> None:
            pool["bytes"] = 0
            real_clear()

        monkeypatch.setattr(e.monitor, "reader", Reader())
        monkeypatch.setattr(e.monitor, "limit_bytes", 10 * gib)
        monkeypatch.setattr(mx, "clear_cache", clear)
        generate(e, random_prompt(40, seed=9), max_tokens=2)
        s = e.stats()
        assert pool["bytes"] == 0  # given back
        assert s.hot.max_bytes == e.settings.hot_bytes
        assert s.hot.evictions == before.evictions and s.hot.nbytes >= before.nbytes
        assert not any(t.startswith("memory ") for _, t in s.events), s.events
    finally:
        e.close()


def test_a_turn_that_extends_the_resident_cache_is_not_charged_it_twice(
    tmp_path, models_dir, monkeypatch
):
    """At a request's start the resident cache it will take is held by the tiers and is
    also inside the request's reservation (its K/V at full length). Charged twice, the hot
    tier was shrunk for memory that was never going to be needed (an H200 at 124K tokens:
    the whole tier, 34 GB, evicted at every request's start). The limit here puts weights
    + reservation + hot tier just under the soft line: the resident cache's bytes on top
    would cross it, so the old accounting evicted; nothing is evicted now."""
    from tierchat.core.memory.readings import MemoryReading

    e = make_engine("tiny:llama", tmp_path, models_dir)
    try:
        turn1 = random_prompt(400, seed=21)
        r1, _ = generate(e, turn1, max_tokens=8)
        turn2 = tuple(turn1) + tuple(r1.token_ids) + random_prompt(120, seed=22)
        before = e.stats().hot
        gate, cache = e.executor.memory_gate, e.runtime.cache
        resident = cache.hot.reserved
        assert resident > 0 and before.nbytes > 0

        class Reader:  # MLX's own figures small: the level is the accounting's
            def read(self) -> MemoryReading:
                return MemoryReading(active=1, peak=1, cache=0)

        monkeypatch.setattr(e.monitor, "reader", Reader())
        limit = 1 << 40
        for _ in range(3):  # the footprint's chunk is planned under the limit's line
            monkeypatch.setattr(e.monitor, "limit_bytes", limit)
            fp = e.runtime.footprint(e.settings, len(turn2), 4, gate.plan_line())
            below_soft = gate.base_bytes + fp.peak_bytes + before.nbytes
            limit = int((below_soft + resident // 2) / e.monitor.soft_fraction)
        monkeypatch.setattr(e.monitor, "limit_bytes", limit)
        soft_line = e.monitor.soft_fraction * limit
        assert below_soft < soft_line < below_soft + resident  # charged twice: soft

        r2, _ = generate(e, turn2, max_tokens=4)
        s = e.stats()
        assert r2.metrics.cached_tokens >= len(turn1)
        assert s.hot.evictions == before.evictions and s.hot.nbytes >= before.nbytes
    finally:
        e.close()
