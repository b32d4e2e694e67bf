"""Continue a reply cut at ``max_tokens`` (docs/DESIGN.md §8.1): the prompt is the previous
prompt + the reply's ids, all of it in the resident cache with the logprobs kept after the
reply's last token, so nothing is prefilled and the tokens are those of one longer
generation (greedy, CPU float32)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_kit import LOGPROB_TOL, generate, make_engine, random_prompt

PROMPT = random_prompt(45, seed=21)


@pytest.mark.parametrize(
    ("arch", "bitwise"), [("llama", True), ("llama", False), ("qwen2", False), ("gemma3", True)]
)
def test_continue_prefills_nothing_and_equals_one_longer_generation(
    tmp_path, models_dir, arch, bitwise
):
    model = f"tiny:{arch}"
    cold = make_engine(model, tmp_path / "cold", models_dir, no_cache=True, bitwise=bitwise)
    cold.record_logprobs = 8
    try:
        whole, whole_handle = generate(cold, PROMPT, max_tokens=8)
    finally:
        cold.close()
    e = make_engine(model, tmp_path, models_dir, bitwise=bitwise)
    try:
        part, _ = generate(e, PROMPT, max_tokens=4)
        assert part.metrics.finish_reason == "length"
        more, handle = generate(e, PROMPT + part.token_ids, max_tokens=4)
        m = more.metrics
        assert m.prefill_tokens == 0, m
        assert m.cached_kind["resident"] == len(PROMPT) + 4 == m.cached_by["hot"], m
        assert part.token_ids + more.token_ids == whole.token_ids
        # the continuation's first token came from the logprobs kept after the reply
        for a, b in zip(handle.trace.logprobs, whole_handle.trace.logprobs[4:], strict=False):
            assert float(np.abs(a - b).max()) < LOGPROB_TOL
        assert any("whole (a continue)" in text for _, text in e.stats().events)
    finally:
        e.close()


def test_continue_after_a_one_token_reply_from_kept_logprobs(tmp_path, models_dir):
    """A regenerate of one token (first token from the kept logprobs, then the forward
    a cold run's cache also holds) continues from the logprobs after that token."""
    model = "tiny:llama"
    cold = make_engine(model, tmp_path / "cold", models_dir, no_cache=True)
    try:
        whole, _ = generate(cold, PROMPT, max_tokens=5)
    finally:
        cold.close()
    e = make_engine(model, tmp_path, models_dir)
    try:
        generate(e, PROMPT, max_tokens=1)
        again, _ = generate(e, PROMPT, max_tokens=1)  # the resident, zero forward
        assert again.metrics.prefill_tokens == 0
        more, _ = generate(e, PROMPT + again.token_ids, max_tokens=4)
        assert more.metrics.prefill_tokens == 0, more.metrics
        assert again.token_ids + more.token_ids == whole.token_ids
    finally:
        e.close()


def test_a_session_continue_grows_the_reply_in_place_as_one_longer_generation(tmp_path, models_dir):
    """Two continues of a reply cut at 4 tokens: one reply (one swipe) holding the 12
    tokens one cold generation of 12 makes, nothing prefilled by either continue; undo
    gives the cut versions back, newest first (core/chat/trash.py)."""
    from tierchat.core.chat.conversation_settings import ConversationSettings
    from tierchat.core.chat.session import ChatSession
    from tierchat.core.chat.store import ConversationStore
    from tierchat.core.chat.trash import Trash

    cold = make_engine("tiny:llama", tmp_path / "cold", models_dir, no_cache=True)
    e = make_engine("tiny:llama", tmp_path, models_dir)
    store = ConversationStore(tmp_path / "c.sqlite")
    try:
        session = ChatSession(e, store, ConversationSettings.of(max_tokens=4))
        session.new_conversation(system="You are terse.")
        cut = session.send("Tell me about the tides and the moon, please.").wait(120)
        assert cut.metrics.finish_reason == "length"
        reply = session.active_path()[-1]
        prompt = session.build_prompt(store.path_to(reply.parent_id)).token_ids
        whole, _ = generate(cold, prompt, max_tokens=12)
        for k in (1, 2):
            more = session.continue_reply().wait(120)
            assert more.metrics.prefill_tokens == 0, more.metrics
            grown = session.active_path()[-1]
            assert grown.id == reply.id and len(store.replies(reply.parent_id)) == 1
            assert grown.token_ids == whole.token_ids[: 4 * (k + 1)]
            assert grown.meta["continued"] == k
        assert grown.content == e.tokenizer.decode(list(whole.token_ids), skip_special_tokens=True)
        trash = Trash(store)
        trash.restore()
        assert store.get_node(reply.id).token_ids == whole.token_ids[:8]
        trash.restore()
        back = store.get_node(reply.id)
        assert back.token_ids == reply.token_ids and back.content == reply.content
    finally:
        cold.close()
        e.close()
        store.close()
