"""The CPU softmax (pow or exp: a timing probe) keys the cache's entries; its first choice
is kept with the cache, so a restart under another load finds the same entries
(core/engine/attention.py ``remembered_pow``, docs/DESIGN.md §7)."""

from __future__ import annotations

import json

from engine_kit import generate, make_engine, random_prompt
from tierchat.core.engine import attention
from tierchat.core.engine.attention import remembered_pow


def test_the_first_probe_is_kept_and_a_bad_file_is_probed_again(tmp_path):
    choice = tmp_path / "kv" / "softmax.json"
    assert remembered_pow(choice, lambda: True) is True
    assert json.loads(choice.read_text()) == {"pow_softmax": True}
    assert choice.stat().st_mode & 0o077 == 0
    assert remembered_pow(choice, lambda: False) is True  # the kept choice, not the probe
    choice.write_text("{not json")
    assert remembered_pow(choice, lambda: False) is False
    assert remembered_pow(choice, lambda: True) is False
    assert remembered_pow(None, lambda: True) is True


def test_a_restart_whose_probe_disagrees_restores_from_the_ssd_tier(
    tmp_path, models_dir, monkeypatch
):
    prompt = random_prompt(80, seed=3)
    monkeypatch.setattr(attention, "pow_is_faster", lambda *a, **k: True)
    first = make_engine("tiny:llama", tmp_path, models_dir, ssd_admission=False)
    cold, _ = generate(first, prompt)
    first.close()
    monkeypatch.setattr(attention, "pow_is_faster", lambda *a, **k: False)
    again = make_engine("tiny:llama", tmp_path, models_dir, ssd_admission=False)
    try:
        hot, _ = generate(again, prompt)
    finally:
        again.close()
    assert hot.metrics.cached_by["ssd"] >= 64
    assert hot.token_ids == cold.token_ids
