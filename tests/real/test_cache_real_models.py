"""Cache paths on the real demo models against cold runs (slow; CI runs them too).

``demo`` (Qwen2.5-Coder-0.5B, KVCache on every layer): append, regenerate, edit, restart
then continue from SSD, clear hot then continue. ``demo-gemma`` (Gemma 3 270M: 5 of 6
layers slide over a 512-token window, RotatingKVCache): a prompt longer than the window,
then append, regenerate, restart then continue from SSD.
"""

from __future__ import annotations

import pytest
from engine_kit import Lockstep

pytestmark = pytest.mark.slow

PARAGRAPH = (
    "The harbour master keeps a ledger of every ship: its name, its cargo, the hour it "
    "arrived and the hour it left, the weather on both days and the pilot who brought it "
    "in. Over the years the ledger has become a history of the town itself. "
)


@pytest.fixture
def pairs():
    made = []
    yield made
    for p in made:
        p.close()


def test_demo_cache_paths_equal_cold(pairs, tmp_path, models_dir):
    pair = Lockstep("demo", tmp_path, models_dir, max_tokens=8, block_size=64)
    pairs.append(pair)
    pair.run("new_conversation", "You are a helpful assistant. " + PARAGRAPH)
    pair.run("send", "Write a Python function that checks whether a number is prime.")
    stored = pair.last_sequence
    m = pair.run("send", "Now make it faster for large numbers. " + PARAGRAPH)
    assert m.prefill_tokens <= m.prompt_tokens - pair.reused(stored) + 1
    assert pair.reused(stored) == len(stored)  # the reply's ids were spliced back whole
    m = pair.run("regenerate")  # the resident cache and its kept first-token logprobs
    assert m.prefill_tokens == 0 and m.cached_kind["resident"] == m.prompt_tokens
    m = pair.run("edit", 0, "Write a Python function that reverses a string.")
    assert m.cached_tokens >= 64
    stored = pair.last_sequence
    pair.restart()
    m = pair.run("send", "Explain it in one sentence.")
    assert m.cached_by["ssd"] > 0 and m.cached_by["hot"] == 0
    assert m.prefill_tokens <= m.prompt_tokens - pair.reused(stored) + 1
    pair.hot_engine.clear("hot")
    m = pair.run("regenerate")
    assert m.prefill_tokens == 1 and m.cached_by["hot"] == 0


def test_demo_gemma_window_cache_equal_cold(pairs, tmp_path, models_dir):
    pair = Lockstep("demo-gemma", tmp_path, models_dir, max_tokens=8, block_size=128)
    pairs.append(pair)
    assert any(k.endswith(":window") for k in pair.hot_engine.stats().layer_kinds)
    pair.run("new_conversation", None)
    m = pair.run("send", PARAGRAPH * 12 + "What does the ledger record?")
    assert m.prompt_tokens > 512  # longer than the sliding window
    stored = pair.last_sequence
    m = pair.run("send", "And who keeps it? " + PARAGRAPH)
    assert m.prefill_tokens <= m.prompt_tokens - pair.reused(stored) + 1
    m = pair.run("regenerate")  # the windows rotated: not cut back in place, N-1 + 1
    assert m.prefill_tokens == 1
    stored = pair.last_sequence
    pair.restart()
    m = pair.run("send", "Answer in one word.")
    assert m.cached_by["ssd"] > 0 and m.cached_by["hot"] == 0
    assert m.prefill_tokens <= m.prompt_tokens - pair.reused(stored) + 1
