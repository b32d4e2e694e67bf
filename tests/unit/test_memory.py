"""Memory readings, levels, the budget policy and the prefill guard (core/memory/pressure.py).

Levels and budgets run on injected readings. The prefill estimate is compared with peaks
measured by MLX (``mx.reset_peak_memory()``, a real prefill, ``mx.get_peak_memory()``):
asserted ``measured <= estimate <= 3 × measured`` on the totals (weights included), and on
the part above the weights ``measured <= estimate <= 2 × measured`` for attention models.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from tierchat.core.api import MemoryStats
from tierchat.core.engine.attention import (
    ALL_QUERIES,
    AttentionPlan,
    chunk_attention,
    pow_softmax,
)
from tierchat.core.memory import prefill as MP
from tierchat.core.memory import pressure as M
from tierchat.core.memory import readings as MR
from tierchat.core.models.loading import load_model
from tierchat.core.units import fmt_bytes

GB = 10**9


def reader(active=0, cache=0, peak=0, total=16 * GB, available=None, device=None):
    """A MemoryReader fed fixed readings; ``available`` defaults to total - active - cache."""
    avail = total - active - cache if available is None else available
    return MR.MemoryReader(
        mlx=lambda: (active, peak or active, cache),
        device_info=lambda: device or {"device_name": "cpu", "architecture": "x86_64"},
        system=lambda: (total, avail),
    )


# ------------------------------------------------------------------ readings


def test_parse_meminfo_and_fallback():
    text = "MemTotal:       16000000 kB\nMemFree:  1000 kB\nMemAvailable:    8000000 kB\n"
    assert MR.parse_meminfo(text) == (16000000 * 1024, 8000000 * 1024)
    old = "MemTotal: 100 kB\nMemFree: 10 kB\nBuffers: 5 kB\nCached: 20 kB\n"
    assert MR.parse_meminfo(old) == (100 * 1024, 35 * 1024)


def test_parse_vm_stat():
    text = (
        "Mach Virtual Memory Statistics: (page size of 16384 bytes)\n"
        "Pages free:                               1000.\n"
        "Pages active:                             9999.\n"
        "Pages inactive:                            200.\n"
        "Pages speculative:                          30.\n"
        "Pages wired down:                         5555.\n"
    )
    assert MR.parse_vm_stat(text) == (1000 + 200 + 30) * 16384


def test_device_memory_keys():
    assert MR.device_memory({"device_name": "AMD EPYC", "architecture": "x86_64"}) == (0, 0)
    metal = {"memory_size": 32 * GB, "max_recommended_working_set_size": 24 * GB}
    assert MR.device_memory(metal) == (32 * GB, 24 * GB)
    assert MR.device_memory({"total_memory": 80 * GB, "free_memory": 1}) == (80 * GB, 0)


def test_real_reader_reads_this_machine():
    r = MR.MemoryReader().read()
    assert r.system_total > 0 and 0 < r.system_available <= r.system_total
    x = mx.ones((1024, 1024))
    mx.eval(x)
    assert MR.MemoryReader().read().active >= x.nbytes


# ------------------------------------------------------------------ levels and budget


def test_default_limit_is_share_of_smaller_memory():
    r = MR.MemoryReading(device_total=8 * GB, system_total=16 * GB)
    assert M.default_limit(r) == int(0.9 * 8 * GB)
    metal = MR.MemoryReading(device_total=16 * GB, device_recommended=11 * GB, system_total=16 * GB)
    assert M.default_limit(metal) == 11 * GB
    assert M.default_limit(MR.MemoryReading(system_total=10 * GB)) == 9 * GB
    assert M.default_limit(MR.MemoryReading()) == 0


@pytest.mark.parametrize(
    "active, cache, level",
    [
        (5 * GB, 0, "ok"),
        (7 * GB, 0, "ok"),
        (7 * GB, GB, "soft"),
        (9 * GB, 0, "soft"),
        (9 * GB, GB // 5, "hard"),
        (10 * GB, 0, "hard"),
    ],
)
def test_levels_from_active_plus_cache(active, cache, level):
    # limit 10 GB: soft line 8 GB, hard line 9.2 GB; the system has plenty left
    mon = M.MemoryMonitor(limit_bytes=10 * GB, reader=reader(active, cache, total=64 * GB))
    assert mon.level() == level
    assert mon.stats().level == level


def test_other_programs_lower_the_ceiling():
    # 4 GB ours, only 1 GB left on the machine: ceiling 5 GB, 80% of it in use -> soft
    mon = M.MemoryMonitor(limit_bytes=10 * GB, reader=reader(4 * GB, available=GB))
    assert mon.ceiling() == 5 * GB and mon.level() == "soft"
    full = M.MemoryMonitor(limit_bytes=10 * GB, reader=reader(4 * GB, available=GB // 4))
    assert full.level() == "hard"


def test_stats_snapshot():
    rd = reader(3 * GB, GB // 2, peak=4 * GB, total=16 * GB, device={"memory_size": 8 * GB})
    s = M.MemoryMonitor(reader=rd).stats()
    assert isinstance(s, MemoryStats)
    assert (s.active, s.cache, s.peak) == (3 * GB, GB // 2, 4 * GB)
    assert (s.device_total, s.system_total) == (8 * GB, 16 * GB)
    assert s.limit == int(0.9 * 8 * GB) and s.level == "ok"


def test_monitor_rejects_bad_fractions():
    with pytest.raises(ValueError):
        M.MemoryMonitor(soft_fraction=0.95, hard_fraction=0.9, reader=reader())
    with pytest.raises(ValueError):
        M.MemoryMonitor(limit_bytes=0, reader=reader())


def test_budget_ok_soft_hard():
    kw = dict(held_bytes=3 * GB, ceiling_bytes=10 * GB, soft_fraction=0.8)
    assert M.effective_budget(4 * GB, "ok", in_use_bytes=9 * GB, **kw) == 4 * GB
    # 8.5 GB in use, soft line 8 GB: the cache gives back the 0.5 GB excess
    assert M.effective_budget(4 * GB, "soft", in_use_bytes=int(8.5 * GB), **kw) == int(2.5 * GB)
    # more excess than the cache holds: never below 0 (or min_bytes)
    assert M.effective_budget(4 * GB, "soft", in_use_bytes=20 * GB, **kw) == 0
    assert M.effective_budget(4 * GB, "soft", in_use_bytes=20 * GB, min_bytes=GB, **kw) == GB
    # never above the configured budget
    assert M.effective_budget(GB, "soft", in_use_bytes=int(8.1 * GB), **kw) == GB
    assert (
        M.effective_budget(4 * GB, "hard", in_use_bytes=9 * GB, min_bytes=GB // 8, **kw) == GB // 8
    )


def test_budget_does_not_charge_what_is_leaving():
    """A resident cache that a starting request takes is in the tiers' bytes and in the
    request's reservation: counted once (``leaving_bytes``), the level and the excess are
    the rest's."""
    monitor = M.MemoryMonitor(limit_bytes=10 * GB, reader=reader(GB, total=64 * GB))
    monitor.committed = lambda: int(9.5 * GB)  # 4 GB of it a resident cache
    assert monitor.level() == "hard" and monitor.budget(6 * GB, held_bytes=6 * GB) == 0
    assert monitor.budget(6 * GB, held_bytes=6 * GB, leaving_bytes=4 * GB) == 6 * GB
    monitor.committed = lambda: int(8.5 * GB)  # soft: the excess over the soft line goes
    assert monitor.budget(6 * GB, held_bytes=6 * GB) == int(5.5 * GB)


def test_monitor_budget_follows_level():
    configured = 4 * GB
    ok = M.MemoryMonitor(limit_bytes=10 * GB, reader=reader(5 * GB, total=64 * GB))
    assert ok.budget(configured, held_bytes=2 * GB) == configured
    soft = M.MemoryMonitor(limit_bytes=10 * GB, reader=reader(int(8.5 * GB), total=64 * GB))
    assert soft.budget(configured, held_bytes=2 * GB) == int(1.5 * GB)
    hard = M.MemoryMonitor(limit_bytes=10 * GB, reader=reader(int(9.5 * GB), total=64 * GB))
    assert hard.budget(configured, held_bytes=2 * GB) == 0


def test_should_clear_mlx_cache():
    assert [M.should_clear_mlx_cache(x) for x in ("ok", "soft", "hard")] == [False, True, True]


# ------------------------------------------------------------------ prefill guard


def test_estimate_terms():
    base = dict(
        active_bytes=GB,
        kv_bytes_per_token=1000,
        n_heads=8,
        vocab_size=1000,
        hidden_size=64,
        dtype_bytes=4,
        intermediate_size=128,
    )
    e = MP.estimate_prefill_peak(new_tokens=100, chunk_tokens=256, context_tokens=100, **base)
    c, t = 100, 100
    kv_new = 1000 * 256  # rounded up to one 256-token step
    # scores: three float32 copies (the engine's attention) + the bool mask, per head
    scratch = c * t * 8 * (3 * 4 + 1) + c * (12 * 64 + 3 * 128) * 4 + 2 * kv_new + c * 1000 * 4
    assert e == int(GB + kv_new + 1.1 * scratch)
    assert MP.estimate_prefill_peak(new_tokens=0, chunk_tokens=256, context_tokens=0, **base) == GB
    one = MP.estimate_prefill_peak(
        new_tokens=100, chunk_tokens=256, context_tokens=100, logits_tokens=1, **base
    )
    assert abs((e - one) - 1.1 * 99 * 1000 * 4) <= 1  # logits of 99 more positions
    # a longer context costs more; a smaller chunk costs less
    longer = MP.estimate_prefill_peak(new_tokens=100, chunk_tokens=256, context_tokens=4000, **base)
    small = MP.estimate_prefill_peak(new_tokens=100, chunk_tokens=32, context_tokens=100, **base)
    assert longer > e > small
    # a fused attention kernel (cuDNN on CUDA) holds no score matrix: none counted
    fused = MP.estimate_prefill_peak(
        new_tokens=100, chunk_tokens=256, context_tokens=100, score_copies=0, **base
    )
    assert abs((e - fused) - 1.1 * c * t * 8 * (3 * 4 + 1)) <= 1


def test_plan_prefill_halves_chunk_then_refuses():
    est = lambda chunk: GB + chunk * 10**6  # noqa: E731
    assert MP.plan_prefill(est, 2 * GB, 2048, 64) == (512, GB + 512 * 10**6)
    # refused at the smallest chunk; every size tried divides the block size
    tried = []

    def rec(chunk):
        tried.append(chunk)
        return 10 * GB

    with pytest.raises(MP.PrefillRefused) as info:
        MP.plan_prefill(rec, 2 * GB, 256, 32, block_size=256, new_tokens=5000)
    assert tried == [256, 128, 64, 32]
    err = info.value
    assert (err.estimate_bytes, err.limit_bytes, err.chunk_tokens) == (10 * GB, 2 * GB, 32)
    msg = str(err)
    for part in (
        "9.3 GiB",  # 10 GB in the one (binary) form of core.units
        "1.9 GiB",
        "5,000 new tokens",
        "shorter prompt",
        "--block-size",
        "clearing cache tiers",
        "--memory-limit",
    ):
        assert part in msg, part


# ------------------------------------------------------------------ KV profile


def _model(**kw):
    args = dict(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=512,
        tie_word_embeddings=False,
    )
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**{**args, **kw}))
    mx.eval(model.parameters())
    return model


def _prefill(model, n_tokens, chunk, caches=None, eval_logits=False):
    """Prefill like the engine: chunk by chunk, evaluating only the cache state, through
    the engine's attention on the CPU (core/engine/attention.py: explicit scores, the pow
    softmax); with ``eval_logits`` the last chunk's logits too (mlx-lm computes them for
    every position)."""
    caches = caches if caches is not None else make_prompt_cache(model)
    tokens = [(7 * i) % 250 + 1 for i in range(n_tokens)]
    with chunk_attention(ENGINE_ATTENTION):
        for i in range(0, n_tokens, chunk):
            out = model(mx.array(tokens[i : i + chunk])[None], cache=caches)
            last = i + chunk >= n_tokens
            mx.eval(out[:, -1, :] if last and eval_logits else [], [c.state for c in caches])
    return caches


# the CPU engine's attention plan (plan_attention on the CPU, where pow is the faster)
ENGINE_ATTENTION = AttentionPlan(max_query=ALL_QUERIES, min_query=1, softmax=pow_softmax)


def test_kv_profile_matches_cache_nbytes():
    model = _model()  # 2 layers × K+V × 2 heads × 32 dims × 4 bytes
    prof = MP.kv_profile(model)
    assert prof == MP.KVProfile(per_token=2 * 2 * 2 * 32 * 4)
    assert MP.kv_bytes_per_token(model) == 1024
    for n in (100, 512, 600):
        caches = _prefill(model, n, 256)
        assert sum(c.nbytes for c in caches) == prof.nbytes(n, 256)


def test_kv_profile_rotating_and_arrays(models_dir):
    sliding = _model(
        num_hidden_layers=3,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    prof = MP.kv_profile(sliding)
    assert prof.per_token == 512 and prof.windows == ((512, 64), (512, 64))
    for n, chunk in ((50, 256), (1024, 256), (1000, 1000)):
        caches = _prefill(sliding, n, chunk)
        assert isinstance(caches[0], RotatingKVCache) and isinstance(caches[1], KVCache)
        assert sum(c.nbytes for c in caches) == prof.nbytes(n, chunk)
    # a short last chunk (1000 = 3 × 256 + 232) holds less than a full one would
    assert sum(c.nbytes for c in _prefill(sliding, 1000, 256)) < prof.nbytes(1000, 256)
    # ArraysCache only: fixed size, nothing per token
    mamba = load_model("tiny:mamba2", models_dir=models_dir).model
    prof = MP.kv_profile(mamba)
    assert prof.per_token == 0 and prof.windows == () and prof.fixed > 0
    assert MP.kv_bytes_per_token(mamba) == 0
    assert sum(c.nbytes for c in _prefill(mamba, 300, 256)) == prof.fixed


# ------------------------------------------------------------------ estimate vs measured


def measure(model, n_tokens, chunk, eval_logits):
    """(measured peak, estimate, active before) for a cold prefill of ``n_tokens``."""
    prof = MP.kv_profile(model)
    mx.clear_cache()
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    caches = _prefill(model, n_tokens, chunk, eval_logits=eval_logits)
    peak = mx.get_peak_memory()
    del caches
    est = MP.estimate_for_model(
        model,
        prof,
        active_bytes=active,
        new_tokens=n_tokens,
        context_tokens=n_tokens,
        chunk_tokens=chunk,
        logits_tokens=None if eval_logits else 1,
    )
    return peak, est, active


@pytest.mark.parametrize("n_tokens", [256, 1024, 2048])
@pytest.mark.parametrize("chunk, eval_logits", [(256, False), (2048, True)])
def test_estimate_bounds_measured_peak(n_tokens, chunk, eval_logits):
    model = _model(
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=704,
        num_attention_heads=8,
        vocab_size=4096,
    )
    peak, est, active = measure(model, n_tokens, chunk, eval_logits)
    print(
        f"T={n_tokens} chunk={chunk} measured {fmt_bytes(peak)} estimate "
        f"{fmt_bytes(est)} ratio {est / peak:.2f} above weights "
        f"{(est - active) / (peak - active):.2f}"
    )
    assert peak <= est <= 3 * peak
    assert peak - active <= est - active <= 2 * (peak - active)


@pytest.mark.parametrize("arch", ["gemma3", "llama_sliding", "qwen3_next", "mamba2", "falcon_h1"])
def test_estimate_bounds_measured_peak_tiny_archs(arch, models_dir):
    model = load_model(f"tiny:{arch}", models_dir=models_dir).model
    for n_tokens, chunk in ((256, 256), (1024, 256), (1024, 1024)):
        peak, est, _ = measure(model, n_tokens, chunk, eval_logits=False)
        assert peak <= est <= 3 * peak, (arch, n_tokens, chunk, peak, est)


def test_guard_refuses_what_would_not_fit():
    model = _model()
    prof = MP.kv_profile(model)
    active = mx.get_active_memory()

    def est(chunk):
        return MP.estimate_for_model(
            model,
            prof,
            active_bytes=active,
            new_tokens=4096,
            context_tokens=4096,
            chunk_tokens=chunk,
            logits_tokens=1,
        )

    chunk, e = MP.plan_prefill(est, est(64) + 1, 256, 32, block_size=256)
    assert chunk == 64 and e == est(64)
    with pytest.raises(MP.PrefillRefused, match="over the memory limit"):
        MP.plan_prefill(est, est(32) - 1, 256, 32, block_size=256, new_tokens=4096)


@pytest.mark.slow
def test_estimate_bounds_measured_peak_demo(models_dir):
    model = load_model("demo", models_dir=models_dir).model
    cases = [(512, 256, False), (1024, 256, False), (2048, 256, False), (2048, 2048, True)]
    for n_tokens, chunk, eval_logits in cases:
        peak, est, active = measure(model, n_tokens, chunk, eval_logits)
        print(
            f"demo T={n_tokens} chunk={chunk} logits={eval_logits}: measured {peak} B, "
            f"estimate {est} B, ratio {est / peak:.3f}; above the weights "
            f"{(peak - active) / 1e6:.1f} MB vs {(est - active) / 1e6:.1f} MB "
            f"({(est - active) / (peak - active):.2f}x)"
        )
        assert peak <= est <= 3 * peak
        assert peak - active <= est - active <= 2 * (peak - active)


def test_an_unreadable_system_reading_keeps_the_last_good_one():
    """Out of file descriptors, /proc/meminfo cannot be opened: the monitor keeps the last
    reading it had instead of judging against "no memory at all"."""
    readings = [(16 * GB, 8 * GB), (0, 0)]
    now = [0.0]
    rd = MR.MemoryReader(
        mlx=lambda: (GB, GB, 0),
        device_info=lambda: {"device_name": "cpu", "architecture": "x86_64"},
        system=lambda: readings.pop(0) if len(readings) > 1 else readings[0],
        clock=lambda: now[0],
    )
    assert rd.read().system_total == 16 * GB
    now[0] += 3600  # past the reading's time to live: the system is read again, and fails
    again = rd.read()
    assert (again.system_total, again.system_available) == (16 * GB, 8 * GB)
