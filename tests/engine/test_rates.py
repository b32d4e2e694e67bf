"""Restore or recompute, chosen per request from measured rates (core/cache/rates.py)."""

from __future__ import annotations

import json

from engine_kit import assert_same, generate, make_engine, random_prompt
from tierchat.core.cache.rates import MIN_BYTES, MIN_TOKENS, Rates


def test_rates_average_choose_and_survive_a_restart(tmp_path):
    path = tmp_path / "rates.json"
    rates = Rates(path)
    assert rates.choose(1000, 10 << 20) is None  # nothing measured yet: read the SSD
    rates.observe_prefill(MIN_TOKENS - 1, 0.001)  # too small to say anything
    rates.observe_read(MIN_BYTES - 1, 0.001)
    assert rates.prefill_tps == rates.read_bps == 0
    rates.observe_prefill(4000, 0.1)  # 40K tok/s
    rates.observe_read(100 << 20, 1.0)  # 100 MiB/s
    slow_disk = rates.choose(4000, 50 << 20)  # 0.5 s to read, 0.1 s to compute
    assert slow_disk.taken == "recompute"
    assert slow_disk.describe().startswith("recompute 4,000 tok, 50.0 MiB, est 0.10 s < ssd 0.50 s")
    assert rates.choose(4000, 5 << 20).taken == "ssd"
    rates.save()
    again = Rates(path)
    assert again.prefill_tps == 40000 and again.read_bps == 100 << 20
    path.write_text("{not json")
    assert Rates(path).prefill_tps == 0  # unreadable: measured again


def _rates_file(tmp_path):
    (found,) = (tmp_path / "kv").glob("rates-*.json")
    return found


def test_after_a_restart_a_slow_disk_is_recomputed_and_a_fast_one_read(tmp_path, models_dir):
    """The engine measures both rates and keeps them next to the SSD files; after a
    restart, the SSD tier is read when that is estimated faster, and the tokens computed
    again when the disk is (made) slower, the output equal to a cold run either way."""
    prompt = random_prompt(700, seed=31)
    cold = make_engine("tiny:llama", tmp_path / "cold", models_dir, no_cache=True)
    hot = make_engine("tiny:llama", tmp_path, models_dir, block_size=64)
    try:
        ref, h_ref = generate(cold, prompt, max_tokens=3)
        generate(hot, prompt[:600], max_tokens=3)  # a 600-token prefill: a measured rate
        hot.close()
        rates = json.loads(_rates_file(tmp_path).read_text())
        assert rates["prefill_tps"] > 0

        # a disk as fast as memory: the SSD tier is read
        _rates_file(tmp_path).write_text(json.dumps({**rates, "read_bps": 1e15}))
        hot = make_engine("tiny:llama", tmp_path, models_dir, block_size=64)
        out, h_out = generate(hot, prompt, max_tokens=3)
        assert out.metrics.cached_by["ssd"] > 0
        assert out.metrics.restore_choice.startswith("ssd ")
        assert_same(ref, h_ref, out, h_out)
        hot.close()

        # a disk far slower than computing: the same request recomputes
        _rates_file(tmp_path).write_text(json.dumps({**rates, "read_bps": 1.0}))
        hot = make_engine("tiny:llama", tmp_path, models_dir, block_size=64)
        out, h_out = generate(hot, prompt, max_tokens=3)
        assert out.metrics.cached_by["ssd"] == 0 and out.metrics.cached_tokens == 0
        assert out.metrics.restore_choice.startswith("recompute ")
        assert_same(ref, h_ref, out, h_out)
        assert any("recompute" in text for _, text in hot.stats().events)
    finally:
        cold.close()
        hot.close()
