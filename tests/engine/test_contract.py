"""One contract, two engines: the same scenarios over ``FakeEngine`` and the real engine on
``tiny:llama``. The TUI and session tests trust the fake; this file is why they may.

What both must do (core/api.py): events in order (prefill progress, token batches, one
terminal event) with the handle done *before* the callback hears the terminal event;
metrics that add up (cached + prefilled = prompt; ``cached_by`` over the tiers and
``cached_kind`` over the entry kinds each sum to the cached tokens); a later turn reuses
the earlier one's prefix; a regenerate of the same prompt is a full hit; a cancel during
prefill is ``Failed(kind="cancelled")`` and stores nothing; ``max_tokens`` holds;
``clear("all")`` empties every tier; the stats' last turn is the turn's metrics.
"""

from __future__ import annotations

import pytest
from fakes import FakeEngine
from tierchat.core.api import (
    CACHE_KINDS,
    CACHE_SOURCES,
    Failed,
    Finished,
    PrefillProgress,
    TokenBatch,
)
from tierchat.core.chat.conversation_settings import ConversationSettings
from tierchat.core.chat.session import ChatSession
from tierchat.core.chat.store import ConversationStore
from tierchat.core.sampling_params import SamplingParams

TIMEOUT = 120
SYSTEM = "You answer in one short line."
QUESTION = "What does a prefix cache keep between two turns of one chat?"


@pytest.fixture(params=["fake", "tiny:llama"])
def engine(request, tmp_path, models_dir):
    if request.param == "fake":
        engine = FakeEngine("fake", block_size=16)
    else:
        from engine_kit import make_engine

        engine = make_engine("tiny:llama", tmp_path, models_dir)
    yield engine
    engine.close()


@pytest.fixture
def session(engine):
    store = ConversationStore(":memory:")
    s = ChatSession(engine, store, ConversationSettings(sampling=SamplingParams(max_tokens=6)))
    s.new_conversation(system=SYSTEM, title="contract")
    yield s
    store.close()


class Recorder:
    """An ``on_event`` that checks, at the terminal event, that the handle is done."""

    def __init__(self) -> None:
        self.events: list = []
        self.handle = None
        self.done_at_terminal: bool | None = None

    def __call__(self, event) -> None:
        self.events.append(event)
        if isinstance(event, (Finished, Failed)):
            self.done_at_terminal = bool(self.handle and self.handle.done)


def turn(start) -> tuple:
    rec = Recorder()
    rec.handle = start(rec)
    return rec.handle.wait(TIMEOUT), rec


def check_metrics(result: Finished) -> None:
    m = result.metrics
    assert m.cached_tokens + m.prefill_tokens == m.prompt_tokens
    assert set(m.cached_by) == set(CACHE_SOURCES) and set(m.cached_kind) == set(CACHE_KINDS)
    assert sum(m.cached_by.values()) == m.cached_tokens
    assert sum(m.cached_kind.values()) == m.cached_tokens
    assert m.generation_tokens == len(result.token_ids)


def test_events_in_order_and_done_before_the_callback(session):
    result, rec = turn(lambda cb: session.send(QUESTION, on_event=cb))
    assert isinstance(result, Finished)
    kinds = [type(e) for e in rec.events]
    assert kinds[-1] is Finished and kinds.count(Finished) == 1
    first_token = kinds.index(TokenBatch)
    assert all(k is PrefillProgress for k in kinds[:first_token])
    assert all(k is TokenBatch for k in kinds[first_token:-1])
    batches = [e for e in rec.events if isinstance(e, TokenBatch)]
    assert sum((e.token_ids for e in batches), ()) == result.token_ids
    assert rec.done_at_terminal is True  # item 12: done is set before the callback runs
    assert session.active_path()[-1].content == result.text  # stored before it, too
    check_metrics(result)


def test_the_next_turn_reuses_the_prefix_and_stats_agree(session, engine):
    first, _ = turn(lambda cb: session.send(QUESTION, on_event=cb))
    before = engine.stats()
    second, _ = turn(lambda cb: session.send("And the second turn?", on_event=cb))
    check_metrics(second)
    m = second.metrics
    assert m.cached_tokens >= first.metrics.prompt_tokens // 2
    stats = engine.stats()
    # served from RAM: hot entries or the resident cache (counted apart, ResidentStats)
    assert m.cached_by["hot"] > 0
    used = stats.hot.hits + stats.resident.hits
    assert used > before.hot.hits + before.resident.hits
    lt = stats.last_turn
    assert (lt.prompt_tokens, lt.cached_tokens, lt.prefill_tokens) == (
        m.prompt_tokens,
        m.cached_tokens,
        m.prefill_tokens,
    )
    assert lt.cached_by == m.cached_by and lt.cached_kind == m.cached_kind


def test_regenerate_is_a_full_hit(session):
    turn(lambda cb: session.send(QUESTION, on_event=cb))
    again, _ = turn(lambda cb: session.regenerate(on_event=cb))
    check_metrics(again)
    m = again.metrics
    # the resident cache holds the whole prompt and the logprobs of its first token
    assert m.cached_tokens == m.prompt_tokens and m.prefill_tokens == 0
    assert m.cached_kind["resident"] == m.prompt_tokens
    assert len(session.replies(0)) == 2


def test_cancel_during_prefill_fails_as_cancelled_and_stores_nothing(session):
    before = session.active_path()

    def start(rec):
        def on_event(event):
            rec(event)
            if isinstance(event, PrefillProgress):
                rec.handle.cancel()

        return session.send(
            "A new question, cancelled while its prompt is read.", on_event=on_event
        )

    result, rec = turn(start)
    assert isinstance(result, Failed) and result.kind == "cancelled", result
    assert not any(isinstance(e, TokenBatch) for e in rec.events)
    assert rec.done_at_terminal is True
    assert session.active_path() == before


def test_max_tokens_holds(session):
    result, _ = turn(lambda cb: session.send(QUESTION, max_tokens=2, on_event=cb))
    assert len(result.token_ids) <= 2
    if len(result.token_ids) == 2 and result.token_ids[-1] not in session.engine.eos_token_ids:
        assert result.metrics.finish_reason == "length"


def test_clear_all_empties_every_tier(session, engine):
    turn(lambda cb: session.send(QUESTION, on_event=cb))
    stats = engine.stats()
    assert stats.supported is True and stats.hot.entries > 0
    engine.clear("all")
    stats = engine.stats()
    assert (stats.hot.entries, stats.tails.entries) == (0, 0)
    assert stats.ssd.entries == 0 or stats.ssd.queue_depth  # SSD writes may still drain
    cold, _ = turn(lambda cb: session.send("After the clear.", on_event=cb))
    check_metrics(cold)
    assert cold.metrics.cached_by.get("ssd", 0) == 0


def test_the_draft_count_is_the_prompt_the_engine_reads(session, engine):
    """The TUI's live token count (core/chat/draft.py) counts with the engine's tokenizer what
    ``send`` will submit: the prompt length the engine then reports, on both engines."""
    from tierchat.core.chat.draft import count_draft

    turn(lambda cb: session.send(QUESTION, on_event=cb))
    follow = "And a second question, counted while typed?"
    count = count_draft(session, follow)
    assert count.text_tokens == len(engine.tokenizer.encode(follow, add_special_tokens=False))
    result, _ = turn(lambda cb: session.send(follow, on_event=cb))
    assert count.prompt_tokens == result.metrics.prompt_tokens
    assert isinstance(engine.context_length, int) and engine.context_length > count.prompt_tokens
    assert count.context_length == engine.context_length
