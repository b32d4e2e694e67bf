"""ChatSession end to end over FakeEngine and a real ConversationStore; FakeEngine itself."""

from __future__ import annotations

import threading

import pytest
from fakes import FakeEngine
from tierchat.core.api import (
    Failed,
    Finished,
    GenerateRequest,
    ModelLoaded,
    ModelLoading,
    PrefillProgress,
    TokenBatch,
)
from tierchat.core.chat.conversation_settings import ConversationSettings
from tierchat.core.chat.session import ChatSession, SessionError
from tierchat.core.chat.store import ConversationStore
from tierchat.core.sampling_params import SamplingError, SamplingParams

TIMEOUT = 5


@pytest.fixture
def engine():
    e = FakeEngine()
    yield e
    e.close()


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "c.sqlite")
    yield s
    s.close()


@pytest.fixture
def session(engine, store):
    s = ChatSession(engine, store, ConversationSettings(sampling=SamplingParams(max_tokens=64)))
    s.new_conversation(system="Be brief.", title="t")
    return s


def roles(session):
    return [n.role for n in session.active_path()]


def test_send_stores_and_selects_the_reply_before_forwarding(session, engine):
    seen = []
    heard = threading.Event()

    def on_event(event):
        if isinstance(event, Finished):
            seen.append((session.active_path()[-1].content, turn.done))
            heard.set()

    turn = session.send("hello", on_event=on_event)
    result = turn.wait(TIMEOUT)
    assert isinstance(result, Finished)
    assert result.text == "Reply 1 to: hello"
    assert turn.reply_node is not None  # stored before wait() returned
    assert heard.wait(TIMEOUT)
    # stored and selected before the caller heard of it, and the handle already done
    assert seen == [(result.text, True)]
    path = session.active_path()
    assert roles(session) == ["system", "user", "assistant"]
    assert path[1] == turn.user_node and path[2] == turn.reply_node
    assert path[2].token_ids == result.token_ids
    assert path[2].meta["prompt_tokens"] == result.metrics.prompt_tokens
    assert path[2].meta["finish_reason"] == "stop"
    assert path[2].meta["model"] == "fake"
    request = engine.requests[-1]
    assert request.prompt_ids == turn.prompt.token_ids
    assert request.boundaries == turn.prompt.boundaries
    assert [r for _, r in request.boundaries] == ["system", "user"]


def test_events_stream_then_finish(session):
    turn = session.send("hi")
    events = list(turn.events())
    assert isinstance(events[0], PrefillProgress)
    assert isinstance(events[-1], Finished)
    text = "".join(e.text for e in events if isinstance(e, TokenBatch))
    assert text == events[-1].text
    assert turn.done and turn.result is events[-1]


def test_generation_parameters(engine, store):
    s = ChatSession(
        engine,
        store,
        ConversationSettings(
            sampling=SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3)
        ),
        use_cache=False,
    )
    s.send("a").wait(TIMEOUT)
    r = engine.requests[-1]
    assert (
        r.sampling.max_tokens,
        r.sampling.temperature,
        r.sampling.top_p,
        r.sampling.seed,
        r.use_cache,
    ) == (7, 0.5, 0.9, 3, False)
    assert s.active_path()[-1].meta["finish_reason"] == "length"
    s.send("b", max_tokens=100).wait(TIMEOUT)
    assert engine.requests[-1].sampling.max_tokens == 100
    assert s.conversation_id is not None  # send opened a conversation


def test_turns_extend_the_previous_prompt_and_hit_the_cache(session, engine):
    prev = None
    cached = []
    for text in ["first question here", "second one", "third", "fourth"]:
        turn = session.send(text)
        result = turn.wait(TIMEOUT)
        if prev is not None:
            assert turn.prompt.token_ids[: len(prev)] == prev
        prev = turn.prompt.token_ids + result.token_ids
        cached.append(result.metrics.cached_tokens)
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    stats = engine.stats()
    assert stats.hot.entries > 0 and stats.hot.hits > 0
    assert stats.last_turn.cached_tokens == cached[-1]


def test_regenerate_and_swipe(session, engine):
    first = session.send("hello").wait(TIMEOUT)
    turn = session.regenerate()
    second = turn.wait(TIMEOUT)
    assert turn.kind == "regenerate"
    assert engine.requests[-1].prompt_ids == engine.requests[-2].prompt_ids
    # the resident cache holds the whole prompt and its first token's logprobs
    assert second.metrics.cached_kind["resident"] == second.metrics.prompt_tokens
    assert [r.content for r in session.replies(0)] == [first.text, second.text]
    assert session.active_path()[-1].content == second.text
    assert session.selected_reply(0) == (1, 2)
    assert session.swipe(0, 0).content == first.text
    assert session.active_path()[-1].content == first.text
    assert session.selected_reply(0) == (0, 2)
    session.swipe(0, -1)
    assert session.active_path()[-1].content == second.text
    with pytest.raises(SessionError):
        session.swipe(0, 2)
    with pytest.raises(SessionError):
        session.swipe(1, 0)


def test_regenerate_an_earlier_turn_and_negative_turns(session, engine):
    """``regenerate(turn=k)`` answers user turn k again with that turn's prompt, as a
    sibling of its reply; negative turns count from the end (``/swipe -1 0``)."""
    first = session.send("one").wait(TIMEOUT)
    session.send("two").wait(TIMEOUT)
    prompt0 = engine.requests[0].prompt_ids
    turn = session.regenerate(turn=0)
    again = turn.wait(TIMEOUT)
    assert engine.requests[-1].prompt_ids == prompt0
    assert turn.user_node.content == "one"
    assert [r.content for r in session.replies(0)] == [first.text, again.text]
    assert [n.content for n in session.active_path()][-2:] == ["one", again.text]
    assert "two" not in [n.content for n in session.active_path()]
    assert session.swipe(-1, 0).content == first.text
    assert session.selected_reply(0) == (0, 2)  # the path holds "two" again
    assert session.selected_reply(-1) == (0, 1)
    with pytest.raises(SessionError):
        session.regenerate(turn=5)


def test_edit_makes_a_branch(session, store):
    session.send("q1").wait(TIMEOUT)
    session.send("q2").wait(TIMEOUT)
    old_path = session.active_path()
    turn = session.edit(0, "q1 edited")
    result = turn.wait(TIMEOUT)
    assert result.text == "Reply 3 to: q1 edited"
    assert [n.content for n in session.active_path()][1:] == ["q1 edited", result.text]
    siblings = store.siblings(turn.user_node.id)
    assert [n.content for n in siblings] == ["q1", "q1 edited"]
    store.select_child(old_path[0].id, old_path[1].id)  # the old branch is intact
    assert session.active_path() == old_path
    with pytest.raises(SessionError):
        session.edit(5, "x")


def test_failure_stores_nothing(session, engine):
    session.send("q1").wait(TIMEOUT)
    before = session.active_path()
    events = []
    engine.fail_next = "boom"
    turn = session.send("q2", on_event=events.append)
    result = turn.wait(TIMEOUT)
    assert isinstance(result, Failed) and result.message == "boom"
    assert events == [result]
    assert turn.reply_node is None
    assert session.active_path() == before
    # a failed edit restores the selection of the edited turn
    engine.fail_next = "boom"
    session.edit(0, "other").wait(TIMEOUT)
    assert session.active_path() == before
    assert len(session.store.siblings(before[1].id)) == 1
    # a failed regenerate keeps the shown reply
    engine.fail_next = "boom"
    session.regenerate().wait(TIMEOUT)
    assert session.active_path() == before and len(session.replies(0)) == 1


def test_cancel_mid_reply_keeps_the_partial_reply(session, engine):
    engine.gate.clear()  # hold decode after the first batch
    turn = session.send("tell me")
    first = next(turn.events())
    assert isinstance(first, PrefillProgress)
    assert session.busy
    with pytest.raises(SessionError, match="still being generated"):
        session.send("again")
    turn.cancel()
    engine.gate.set()
    result = turn.wait(TIMEOUT)
    assert result.metrics.finish_reason == "cancelled"
    assert 0 < len(result.token_ids) < len("Reply 1 to: tell me")
    reply = session.active_path()[-1]
    assert reply == turn.reply_node
    assert reply.meta["finish_reason"] == "cancelled"
    assert not session.busy


def test_cancel_before_any_token_stores_nothing(session, engine):
    before = session.active_path()
    engine.gate.clear()
    blocker = engine.submit(GenerateRequest((2, 300, 4, 3)))  # holds the worker
    turn = session.send("never answered")
    turn.cancel()
    engine.gate.set()
    blocker.wait(TIMEOUT)
    result = turn.wait(TIMEOUT)
    # cancelled before the first token: the engine says so (as the real one does)
    assert isinstance(result, Failed) and result.kind == "cancelled"
    assert turn.reply_node is None
    assert session.active_path() == before


def test_store_error_is_recorded_and_the_event_still_forwarded(session, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(session.store, "add_node", broken)
    with pytest.raises(RuntimeError):
        session.send("x")  # the user node cannot be stored: nothing is submitted
    monkeypatch.undo()
    session.send("q").wait(TIMEOUT)
    monkeypatch.setattr(session.store, "add_node", broken)
    events = []
    turn = session.regenerate(on_event=events.append)
    assert isinstance(turn.wait(TIMEOUT), Finished)
    assert isinstance(events[-1], Finished)
    assert isinstance(turn.error, RuntimeError) and turn.reply_node is None


def test_regenerate_needs_a_user_message(session):
    with pytest.raises(SessionError, match="nothing to regenerate"):
        session.regenerate()


def test_no_conversation(engine, store):
    s = ChatSession(engine, store)
    assert s.active_path() == []
    with pytest.raises(SessionError, match="no conversation"):
        s.user_turns()
    with pytest.raises(KeyError):
        s.open(12345)


def test_open_fork_delete_rename(session, store):
    session.send("q1").wait(TIMEOUT)
    session.send("q2").wait(TIMEOUT)
    cid = session.conversation_id
    path = session.active_path()
    fork = session.fork(path[2].id)
    assert session.conversation_id == cid
    session.open(fork)
    assert [n.content for n in session.active_path()] == [n.content for n in path[:3]]
    turn = session.send("q2 in the fork")
    turn.wait(TIMEOUT)
    assert len(session.user_turns()) == 2
    session.open(cid)
    session.delete(path[3].id)
    assert session.active_path() == path[:3]
    session.rename("renamed")
    assert store.get_conversation(cid).title == "renamed"


# ---------------------------------------------------------------- FakeEngine itself


def test_fake_engine_stats_and_clear(engine):
    tok = engine.tokenizer
    prompt = tuple(tok.apply_chat_template([{"role": "user", "content": "x" * 40}], True))
    engine.submit(GenerateRequest(prompt)).wait(TIMEOUT)
    s = engine.stats()
    assert s.hot.entries > 0 and s.hot.nbytes > 0 and s.ssd.saves_persisted > 0
    assert s.tails.stashes == 1 and s.supported is True
    r = engine.submit(GenerateRequest(prompt)).wait(TIMEOUT)
    assert r.metrics.cached_kind["resident"] == len(prompt)  # the same prompt again
    engine.clear("resident")
    r = engine.submit(GenerateRequest(prompt)).wait(TIMEOUT)
    # the whole prompt through the tail that kept its first token's logprobs
    assert r.metrics.cached_tokens == len(prompt) and r.metrics.cached_kind["tail"] > 0
    assert r.metrics.cached_tokens + r.metrics.prefill_tokens == r.metrics.prompt_tokens
    engine.clear("hot")
    s = engine.stats()
    assert s.hot.entries == 0 and s.ssd.entries > 0
    assert s.events[-1][1].startswith("cleared hot tier")
    engine.clear("tails")
    r = engine.submit(GenerateRequest(prompt)).wait(TIMEOUT)
    assert r.metrics.cached_by["ssd"] > 0  # hot was cleared, SSD still holds the blocks
    assert r.metrics.prefill_tokens >= 1  # no tail kept the logprobs any more
    engine.clear("all")
    assert engine.stats().ssd.entries == 0
    with pytest.raises(ValueError):
        engine.clear("disk")


def test_fake_engine_unsupported_model_and_fixed_clock():
    e = FakeEngine(supported=False, clock=lambda: 100.0)
    try:
        prompt = tuple(e.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], True))
        for _ in range(2):
            r = e.submit(GenerateRequest(prompt)).wait(TIMEOUT)
            assert r.metrics.cached_tokens == 0
        assert (r.metrics.ttft_s, r.metrics.generation_tps) == (0.0, 0.0)
        s = e.stats()
        assert s.supported is False and s.reason and s.hot.entries == 0
        events = []
        h = e.load_model("other", events.append)
        assert isinstance(h.wait(TIMEOUT), ModelLoaded)
        assert [type(x) for x in events] == [ModelLoading] * 3 + [ModelLoaded]
        assert events[3].warning and e.model_name == "other"
        e.fail_next = "no such model"
        failed = e.load_model("bad").wait(TIMEOUT)
        assert isinstance(failed, Failed) and failed.kind == "load"
    finally:
        e.close()
    with pytest.raises(RuntimeError):
        e.submit(GenerateRequest((1,)))


# ---------------------------------------------------------------- per-conversation settings


def test_settings_are_saved_with_the_conversation_and_used(engine, store):
    from tierchat.core.chat.session import ConversationSettings

    s = ChatSession(
        engine,
        store,
        ConversationSettings(sampling=SamplingParams(max_tokens=64, temperature=0.0, seed=7)),
    )
    cid = s.new_conversation(title="a")
    assert s.settings() == ConversationSettings(sampling=SamplingParams(max_tokens=64, seed=7))
    s.save_settings(
        ConversationSettings.of(
            system="Talk like a pirate.", temperature=0.8, top_p=0.9, max_tokens=32, seed=11
        )
    )
    s.send("hi").wait(TIMEOUT)
    r = engine.requests[-1]
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.max_tokens, r.sampling.seed) == (
        0.8,
        0.9,
        32,
        11,
    )
    assert "<|system|>Talk like a pirate.<|end|>" in engine.tokenizer.decode(r.prompt_ids)
    other = s.new_conversation(title="b")  # another conversation keeps the defaults
    s.send("hi").wait(TIMEOUT)
    assert engine.requests[-1].sampling.temperature == 0.0
    assert s.settings(cid).system == "Talk like a pirate." and s.settings(other).system == ""
    with pytest.raises(SamplingError, match="top_p"):
        s.save_settings(ConversationSettings(sampling=SamplingParams(top_p=0.0)))


def test_regenerate_at_temperature_samples_a_new_seed_each_time(engine, store):
    from tierchat.core.chat.session import ConversationSettings

    s = ChatSession(engine, store)
    s.new_conversation()
    s.save_settings(ConversationSettings(sampling=SamplingParams(temperature=0.7, seed=100)))
    s.send("q").wait(TIMEOUT)
    s.regenerate().wait(TIMEOUT)
    s.regenerate().wait(TIMEOUT)
    assert [r.sampling.seed for r in engine.requests] == [100, 101, 102]
    greedy = SamplingParams(temperature=0.0, seed=100)  # greedy: seed unused
    s.save_settings(ConversationSettings(sampling=greedy, swipe_temperature=0.0))
    s.regenerate().wait(TIMEOUT)
    assert (
        engine.requests[-1].sampling.seed == 100 and engine.requests[-1].sampling.temperature == 0.0
    )


def test_system_prompt_setting_replaces_the_stored_system_root(session, engine):
    from dataclasses import replace

    assert session.settings().system == "Be brief."  # the root message is the default
    session.send("hi").wait(TIMEOUT)
    assert "<|system|>Be brief." in engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    session.save_settings(replace(session.settings(), system="Be long."))
    session.send("again").wait(TIMEOUT)
    text = engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    assert "Be long." in text and "Be brief." not in text
    session.save_settings(replace(session.settings(), system=""))
    session.send("none").wait(TIMEOUT)
    assert "<|system|>" not in engine.tokenizer.decode(engine.requests[-1].prompt_ids)


def test_fork_keeps_the_settings(session):

    session.send("hi").wait(TIMEOUT)
    session.save_settings(session.settings().with_values({"temperature": 0.9}))
    fork = session.fork(session.active_path()[-1].id)
    assert session.settings(fork).sampling.temperature == 0.9


def test_send_without_a_model_is_a_clear_session_error(store):
    class NoModel(FakeEngine):
        @property
        def tokenizer(self):
            return None

    engine = NoModel(model_name="")
    try:
        s = ChatSession(engine, store)
        with pytest.raises(SessionError, match="no model is loaded"):
            s.send("hello")
        assert s.active_path() == []  # the user message was not kept
    finally:
        engine.close()


def test_ids_of_another_model_are_not_spliced(session, engine):
    session.send("hello there").wait(TIMEOUT)
    same = session.build_prompt(session.active_path())
    assert same.spliced == 1
    engine.model_name = "another"
    other = session.build_prompt(session.active_path())
    assert other.spliced == 0
    assert engine.tokenizer.decode(other.token_ids) == engine.tokenizer.decode(same.token_ids)


def test_select_any_sibling_and_path_entries(session):
    session.send("first").wait(TIMEOUT)
    old_user = session.user_turns()[0]
    session.edit(0, "second").wait(TIMEOUT)
    entries = session.path_entries()
    assert [(e.node.role, e.index, e.count) for e in entries][1] == ("user", 1, 2)
    session.select(old_user.id)
    assert session.active_path()[1].content == "first"
    assert session.active_path()[-1].content.endswith("to: first")


def test_settings_keep_the_sampling_controls_per_conversation(session, engine):
    from tierchat.core.chat.session import ConversationSettings

    session.send("hello").wait(TIMEOUT)
    chosen = ConversationSettings(
        sampling=SamplingParams(
            temperature=0.7, top_k=40, min_p=0.05, repetition_penalty=1.3, stop=("END",), seed=3
        )
    )
    session.save_settings(chosen)
    assert session.settings() == chosen  # stored and read back
    session.send("again").wait(TIMEOUT)
    req = engine.requests[-1]
    assert (
        req.sampling.top_k,
        req.sampling.min_p,
        req.sampling.repetition_penalty,
        req.sampling.stop,
    ) == (40, 0.05, 1.3, ("END",))
    other = session.new_conversation()
    assert session.settings(other).sampling.top_k == 0  # another conversation: the defaults
    with pytest.raises(SamplingError, match="top_k"):
        session.save_settings(ConversationSettings(sampling=SamplingParams(top_k=-2)))


def test_a_regenerate_at_temperature_0_samples_at_the_swipe_temperature(engine, store):
    session = ChatSession(
        engine,
        store,
        ConversationSettings(sampling=SamplingParams(seed=5)),  # swipe temperature 0.8
    )
    session.send("hi").wait(TIMEOUT)
    assert engine.requests[-1].sampling.temperature == 0.0  # the turn itself stays greedy
    session.regenerate().wait(TIMEOUT)
    req = engine.requests[-1]
    assert req.sampling.temperature == 0.8 and req.sampling.seed == 5 + 1  # reply 1 of this message


def test_continue_extends_the_last_reply_in_place(session, engine):
    first = session.send("tell me more").wait(TIMEOUT)
    cut = session.active_path()[-1]
    turn = session.continue_reply()
    more = turn.wait(TIMEOUT)
    req = engine.requests[-1]
    assert req.prompt_ids == engine.requests[0].prompt_ids + first.token_ids
    new = session.active_path()[-1]
    assert new.id == cut.id == turn.reply_node.id  # one swipe, grown
    assert new.token_ids == first.token_ids + more.token_ids
    assert new.content == engine.tokenizer.decode(list(new.token_ids), skip_special_tokens=True)
    assert new.meta["continued"] == 1 and new.meta["prompt_tokens"] == len(req.prompt_ids)
    assert [r.id for r in session.replies(0)] == [cut.id]
    session.continue_reply().wait(TIMEOUT)  # twice: still one reply
    assert [r.id for r in session.replies(0)] == [cut.id]
    assert session.active_path()[-1].meta["continued"] == 2
