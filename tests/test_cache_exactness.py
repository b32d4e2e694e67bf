"""The exactness matrix: every cache path against a cold run, on every tiny architecture.

A cached session and a ``no_cache`` session run the same chat operations in lockstep
through the real engine (same block-aligned chunking). Every generation must give the
same greedy tokens and first logprobs within 1e-4 (float32), and cost only what is new:
a regenerate prefills exactly 1 token, an appended turn at most the tokens after the
previous turn's stored sequence + 1.
"""

from __future__ import annotations

import pytest
from engine_kit import assert_same, make_engine
from tierchat.core.conversation import ConversationStore
from tierchat.core.session import ChatSession
from tierchat.core.tiny import TINY_ARCHS

SYSTEM = "You are a careful assistant. Answer briefly, and keep every answer short."
USERS = [
    "Describe the tides, the moon and the wind over the harbour at dusk.",
    "Now compare that with a mountain lake in winter, in two sentences.",
    "Which of the two would a painter choose, and why would they?",
    "Summarise everything so far as a short list of three items.",
]
MAX_TOKENS = 6


class Lockstep:
    """A cached and a cold chat session doing the same thing."""

    def __init__(self, model, tmp, models_dir, **overrides):
        self.model, self.tmp, self.models_dir, self.overrides = model, tmp, models_dir, overrides
        self.cold_engine = make_engine(model, tmp / "cold", models_dir, no_cache=True, **overrides)
        self.cold = ChatSession(
            self.cold_engine, ConversationStore(tmp / "cold.sqlite"), max_tokens=MAX_TOKENS
        )
        self.hot_engine = make_engine(model, tmp, models_dir, **overrides)
        self.store = ConversationStore(tmp / "hot.sqlite")
        self.hot = ChatSession(self.hot_engine, self.store, max_tokens=MAX_TOKENS)
        self.last_sequence = ()  # prompt + reply token ids of the latest finished turn
        self.last_prompt = ()

    def run(self, op, *args):
        a = getattr(self.cold, op)(*args)
        b = getattr(self.hot, op)(*args)
        if not hasattr(a, "wait"):
            return None
        ra, rb = a.wait(120), b.wait(120)
        assert_same(ra, a.request_handle, rb, b.request_handle)
        self.last_prompt = b.prompt.token_ids
        self.last_sequence = b.prompt.token_ids + rb.token_ids
        return rb.metrics

    def reused(self, previous) -> int:
        """Tokens of the latest prompt that continue ``previous`` (the stored sequence).

        Equal to ``len(previous)`` when the reply's ids were spliced back whole; shorter
        when a reply's bytes cannot round-trip through text (random tiny models emit
        invalid UTF-8), in which case the prompt really differs from there on.
        """
        n = 0
        for a, b in zip(previous, self.last_prompt, strict=False):
            if a != b:
                break
            n += 1
        return n

    def restart(self):
        self.hot_engine.close()
        self.hot_engine = make_engine(self.model, self.tmp, self.models_dir, **self.overrides)
        self.hot.engine = self.hot_engine

    def close(self):
        self.cold_engine.close()
        self.hot_engine.close()


@pytest.fixture
def lockstep(request, tmp_path, models_dir):
    pairs = []

    def make(model, **overrides):
        pair = Lockstep(model, tmp_path, models_dir, **overrides)
        pairs.append(pair)
        return pair

    yield make
    for p in pairs:
        p.close()


def run_matrix(pair: Lockstep, block_size: int = 16):
    pair.run("new_conversation", SYSTEM)
    pair.run("send", USERS[0])

    # append a turn: only what follows the stored previous sequence is prefilled
    stored = pair.last_sequence
    m = pair.run("send", USERS[1])
    assert m.prefill_tokens <= m.prompt_tokens - pair.reused(stored) + 1

    # regenerate three times: one token each
    for _ in range(3):
        m = pair.run("regenerate")
        assert m.prefill_tokens == 1, m

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

    # and a regenerate after all that is still one token
    m = pair.run("regenerate")
    assert m.prefill_tokens == 1


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
    from tierchat.core.tiny import SLIDING_WINDOW

    pair = lockstep("tiny:gemma3")
    pair.run("new_conversation", SYSTEM)
    pair.run("send", USERS[0])
    n = len(pair.last_sequence)
    assert n > 2 * SLIDING_WINDOW and n > 4 * 16
