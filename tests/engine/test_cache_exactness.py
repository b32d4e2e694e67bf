"""The exactness matrix: every cache path against a cold run, on every tiny architecture.

A cached session and a ``no_cache`` session run the same chat operations in lockstep
through the real engine (same block-aligned chunking). Every generation must give the
same greedy tokens and first logprobs within 1e-4 (float32), and cost only what is new:
a regenerate prefills no token where every layer of the resident cache can be cut back to
the whole prompt (the first token comes from the kept logprobs; always on plain attention
models) and exactly 1 elsewhere, an appended turn at most the tokens after the previous
turn's stored sequence + 1.
"""

from __future__ import annotations

import pytest
from engine_kit import Lockstep
from tierchat.core.models.tiny import TINY_ARCHS

SYSTEM = "You are a careful assistant. Answer briefly, and keep every answer short."
USERS = [
    "Describe the tides, the moon and the wind over the harbour at dusk.",
    "Now compare that with a mountain lake in winter, in two sentences.",
    "Which of the two would a painter choose, and why would they?",
    "Summarise everything so far as a short list of three items.",
]
MAX_TOKENS = 6


@pytest.fixture
def lockstep(request, tmp_path, models_dir):
    pairs = []

    def make(model, **overrides):
        pair = Lockstep(model, tmp_path, models_dir, max_tokens=MAX_TOKENS, **overrides)
        pairs.append(pair)
        return pair

    yield make
    for p in pairs:
        p.close()


def assert_regenerate_cost(pair: Lockstep, m) -> None:
    """0 tokens prefilled when served from the resident cache and its kept logprobs (always
    on a model of KV layers only), else exactly 1."""
    if m.prefill_tokens == 0:
        assert m.cached_kind["resident"] == m.cached_tokens == m.prompt_tokens, m
    else:
        assert m.prefill_tokens == 1, m
    kinds = {k.split(":")[1] for k in pair.hot_engine.layer_kinds}
    if kinds == {"kv"}:
        assert m.prefill_tokens == 0, m


def run_matrix(pair: Lockstep, block_size: int = 16):
    pair.run("new_conversation", SYSTEM)
    pair.run("send", USERS[0])

    # append a turn: only what follows the stored previous sequence is prefilled
    stored = pair.last_sequence
    m = pair.run("send", USERS[1])
    assert m.prefill_tokens <= m.prompt_tokens - pair.reused(stored) + 1

    # regenerate three times: no token or one each
    for _ in range(3):
        assert_regenerate_cost(pair, pair.run("regenerate"))

    # swipe back to reply 1 and continue
    pair.run("swipe", 1, 0)
    m = pair.run("send", USERS[2])
    assert m.cached_tokens > 0

    # edit turn 0: restores at least up to the system prompt's blocks
    m = pair.run("edit", 0, USERS[3])
    system_end = pair.hot.build_prompt(pair.store.path_to(pair.hot.user_turns()[0].id)).boundaries[
        0
    ][0]
    floor = system_end if pair.hot_engine.cache.state else system_end // block_size * block_size
    assert m.cached_tokens >= floor, (m, system_end)

    # edit the last turn
    pair.run("send", USERS[1])
    last = len(pair.hot.user_turns()) - 1
    m = pair.run("edit", last, USERS[2])
    assert m.cached_tokens > 0

    # restart then continue: SSD (and tails persisted there) only
    stored = pair.last_sequence
    pair.restart()
    m = pair.run("send", USERS[0])
    assert m.cached_by["hot"] == 0 and m.cached_by["ssd"] > 0, m
    assert m.prefill_tokens <= m.prompt_tokens - pair.reused(stored) + 1, m

    # clear hot then continue
    pair.hot_engine.clear("hot")
    stored = pair.last_sequence
    m = pair.run("send", USERS[3])
    assert m.cached_by["hot"] == 0 and m.cached_by["ssd"] > 0, m
    assert m.prefill_tokens <= m.prompt_tokens - pair.reused(stored) + 1, m

    # and a regenerate after all that still costs no token or one
    assert_regenerate_cost(pair, pair.run("regenerate"))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_exactness_matrix(lockstep, arch):
    pair = lockstep(f"tiny:{arch}")
    assert pair.hot_engine.supported is True
    run_matrix(pair)


def test_exactness_quantized_kv(lockstep):
    pair = lockstep("tiny:llama", kv_bits=8, kv_group_size=32)
    run_matrix(pair)


def test_prompts_exceed_windows_and_blocks(lockstep):
    """The matrix's prompts are longer than the tiny sliding window and several blocks."""
    from tierchat.core.models.tiny import SLIDING_WINDOW

    pair = lockstep("tiny:gemma3")
    pair.run("new_conversation", SYSTEM)
    pair.run("send", USERS[0])
    n = len(pair.last_sequence)
    assert n > 2 * SLIDING_WINDOW and n > 4 * 16


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_divergence_inside_a_block_reuses_the_common_prefix(tmp_path, models_dir, arch):
    """KV and window layers restore up to the exact common prefix, even mid-block."""
    from engine_kit import assert_same, generate, make_engine, random_prompt

    hot = make_engine(f"tiny:{arch}", tmp_path, models_dir)
    cold = make_engine(f"tiny:{arch}", tmp_path / "cold", models_dir, no_cache=True)
    try:
        base = random_prompt(120, seed=11)
        generate(hot, base)
        edited = base[:77] + random_prompt(30, seed=12)  # diverges at 77 = 4 * 16 + 13
        a, ha = generate(cold, edited)
        b, hb = generate(hot, edited)
        assert_same(a, ha, b, hb)
        assert b.metrics.cached_tokens == 77
    finally:
        hot.close()
        cold.close()


@pytest.mark.parametrize("by_path", [False, True], ids=["staged", "by-path"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_restart_regenerate_is_bitwise_hot_regenerate_and_cold(
    tmp_path, models_dir, arch, by_path, monkeypatch
):
    """A regenerate served from the SSD tier after a restart gives the logprobs of the same
    regenerate served hot (the resident cache, with its kept first-token logprobs where
    every layer can be cut back to N), bit for bit; with no decode-computed K/V in
    the prompt both equal the cold run bit for bit too. Both ways the SSD tier loads a
    file: viewed in its staging arrays, and verified then ``mx.load``-ed (CUDA's)."""
    import numpy as np
    from engine_kit import generate, make_engine, random_prompt
    from tierchat.core.cache.ssd.reader import SSDReader

    monkeypatch.setattr(SSDReader, "by_path", by_path)

    model = f"tiny:{arch}"
    bounds = ((9, "system"), (40, "user"))
    prompt = random_prompt(70, seed=21)
    cold = make_engine(model, tmp_path / "cold", models_dir, no_cache=True)
    hot = make_engine(model, tmp_path, models_dir)
    try:
        ref, h_cold = generate(cold, prompt, max_tokens=4, boundaries=bounds)
        generate(hot, prompt, max_tokens=4, boundaries=bounds)
        a, h_hot = generate(hot, prompt, max_tokens=4, boundaries=bounds)
        # N with the kept logprobs (every layer cut back in place), else N-1 + 1 token
        assert a.metrics.cached_tokens in (len(prompt) - 1, len(prompt))
        hot.close()
        hot = make_engine(model, tmp_path, models_dir)
        b, h_ssd = generate(hot, prompt, max_tokens=4, boundaries=bounds)
        assert b.metrics.cached_by["ssd"] == len(prompt) - 1
        assert ref.token_ids == a.token_ids == b.token_ids
        for x, y, z in zip(h_cold.trace.logprobs, h_hot.trace.logprobs, h_ssd.trace.logprobs, strict=True):
            assert np.array_equal(y, z)  # SSD restore == hot restore, bit for bit
            assert np.array_equal(x, y)  # == cold: the prompt holds no decode K/V
    finally:
        cold.close()
        hot.close()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_exactness_matrix_folded_schedule(lockstep, arch):
    """The default schedule (``bitwise`` off): models without recurrent state fold the last
    prompt token into the last chunk and restore the exact common prefix. Every cache path
    still gives the cold run's greedy tokens and first logprobs within 1e-4."""
    pair = lockstep(f"tiny:{arch}", bitwise=False)
    run_matrix(pair)
