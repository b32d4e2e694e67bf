"""``tierchat serve`` over the fake engine: the official ``openai`` client and raw HTTP on
127.0.0.1, the error shapes, the key check, the queue, prompt splicing across turns.

The real engine on tiny models: tests/real/test_serve_real.py.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from fakes import END_ID, FakeEngine, FakeTokenizer
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.app import create_app
from tierchat.core.serve.log import RequestLog, TrackedEngine
from tierchat.core.serve.prompts import APIError, ReplyMemory, sampling
from tierchat.core.serve.server import ServerThread
from tierchat.core.serve.state import ServeState

SYSTEM = {"role": "system", "content": "You are terse."}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def served():
    """A fake engine behind a server on a free loopback port; yields (state, url)."""
    engine = TrackedEngine(FakeEngine(), RequestLog())
    state = ServeState(engine, sampling=SamplingParams(max_tokens=200))
    server = ServerThread(create_app(state)).start()
    try:
        yield state, server.url
    finally:
        server.stop()
        engine.close()


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_chat_non_streaming_reports_usage_and_cached_tokens_grow(served):
    state, url = served
    c = client(url)
    messages = [SYSTEM, {"role": "user", "content": "Tell me about the weather in Paris."}]
    first = c.chat.completions.create(model="fake", messages=messages)
    text = first.choices[0].message.content
    assert text == "Reply 1 to: Tell me about the weather in Paris."
    assert first.choices[0].finish_reason == "stop"
    assert first.object == "chat.completion" and first.model == "fake"
    u1 = first.usage
    assert u1.prompt_tokens == len(state.engine.engine.requests[0].prompt_ids)
    assert u1.prompt_tokens_details.cached_tokens == 0
    assert u1.total_tokens == u1.prompt_tokens + u1.completion_tokens

    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And Rome?"}]
    second = c.chat.completions.create(model="fake", messages=messages)
    u2 = second.usage
    # the whole first turn (prompt + reply) is reused: the reply's generated ids were spliced
    assert u2.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens
    extra = u2.model_extra["tierchat"]
    assert sum(extra["cached_by"].values()) == u2.prompt_tokens_details.cached_tokens
    assert sum(extra["cached_kind"].values()) == u2.prompt_tokens_details.cached_tokens
    assert extra["prefill_tokens"] == u2.prompt_tokens - u2.prompt_tokens_details.cached_tokens


def test_second_prompt_extends_the_first_sequence_token_exactly(served):
    """The fake generates one id per character; re-tokenizing merges pairs ("th", "er", ...),
    so without the reply memory the second prompt would diverge inside the reply."""
    state, url = served
    c = client(url)
    messages = [{"role": "user", "content": "Where is the river?"}]
    text = c.chat.completions.create(model="m", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Why?"}]
    c.chat.completions.create(model="m", messages=messages)
    first, second = state.engine.engine.requests
    generated = FakeTokenizer().char_ids(text) + [END_ID]
    assert FakeTokenizer().encode(text) != generated[:-1]  # the trap is armed
    assert second.prompt_ids[: len(first.prompt_ids) + len(generated)] == (
        first.prompt_ids + tuple(generated)
    )
    assert [role for _, role in second.boundaries] == ["user", "assistant", "user"]


def test_streaming_matches_non_streaming_and_ends_with_usage(served):
    _, url = served
    c = client(url)
    messages = [{"role": "user", "content": "Stream this, please."}]
    chunks = list(
        c.chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "Reply 1 to: Stream this, please."
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens > 0
    # the streamed reply is remembered like a non-streamed one: turn 2 reuses all of turn 1
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
    again = c.chat.completions.create(model="m", messages=messages)
    u1 = chunks[-1].usage
    assert (
        again.usage.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens
    )


def test_stop_strings_cut_streamed_and_whole_replies(served):
    _, url = served
    c = client(url)
    messages = [{"role": "user", "content": "abc STOP def"}]
    whole = c.chat.completions.create(model="m", messages=messages, stop=["STOP"])
    assert whole.choices[0].message.content == "Reply 1 to: abc "
    assert whole.choices[0].finish_reason == "stop"
    chunks = c.chat.completions.create(model="m", messages=messages, stop="STOP", stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "Reply 2 to: abc "


def test_max_tokens_gives_finish_reason_length(served):
    _, url = served
    r = client(url).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.choices[0].message.content == "Reply"


def test_completions_endpoint_streaming_and_not(served):
    _, url = served
    c = client(url)
    r = c.completions.create(model="m", prompt="<|user|>Once upon a time<|end|>\n")
    assert r.object == "text_completion"
    assert r.choices[0].text == "Reply 1 to: Once upon a time"
    parts = list(c.completions.create(model="m", prompt="<|user|>x<|end|>\n", stream=True))
    assert "".join(p.choices[0].text for p in parts) == "Reply 2 to: x"
    assert parts[-1].choices[0].finish_reason == "stop"


def test_models_and_health(served):
    _, url = served
    assert [m.id for m in client(url).models.list()] == ["fake"]
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["queue"] == {"waiting": 0, "running": 0}


def test_bad_requests_get_openai_error_shape_and_status(served):
    _, url = served
    c = client(url)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "hi"}])
    assert info.value.status_code == 400
    err = info.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == "messages.0.role"
    assert "wizard" in err["message"]

    cases = [
        (b"{not json", "the request body is not valid JSON", None),
        (b'{"model": "m"}', "'messages' must be a non-empty list", "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "only n=1", "n"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}',
            "'temperature' must be in 0..5, not 9",
            "temperature",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}',
            "integer",
            "max_tokens",
        ),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            "image_url",
            "messages.0.content.0",
        ),
    ]
    for raw, message, param in cases:
        r = httpx.post(url + "/v1/chat/completions", content=raw, headers=JSON)
        assert r.status_code == 400, raw
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert message in body["error"]["message"] and body["error"]["param"] == param

    missing = httpx.get(url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_url"
    wrong_method = httpx.get(url + "/v1/chat/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_engine_failure_is_a_500_and_an_error_event_in_a_stream(served):
    state, url = served
    state.engine.engine.fail_next = "boom"
    with pytest.raises(openai.InternalServerError) as info:
        client(url).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["message"] == "boom" and info.value.body["type"] == "server_error"
    state.engine.engine.fail_next = "bang"
    with pytest.raises(openai.APIError, match="bang"):
        list(
            client(url).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream=True
            )
        )
    assert state.log.snapshot().failed == 2


def test_api_key_is_checked_as_bearer():
    engine = TrackedEngine(FakeEngine(), RequestLog())
    state = ServeState(engine, api_key="s3cret")
    with ServerThread(create_app(state)) as server:
        with pytest.raises(openai.AuthenticationError) as info:
            client(server.url, "wrong").models.list()
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key"
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        assert [m.id for m in client(server.url, "s3cret").models.list()] == ["fake"]
        assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    engine.close()


def test_requests_queue_for_the_one_engine_and_the_depth_shows(served):
    state, url = served
    fake = state.engine.engine
    fake.gate.clear()  # hold decode after the first batch
    results: dict[str, str] = {}

    def ask(name: str) -> None:
        r = client(url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": name}], user=name
        )
        results[name] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(n,)) for n in ("one", "two", "three")]
    for t in threads:
        t.start()
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    health = {}
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health").json()
        if health["queue"] == {"waiting": 2, "running": 1}:
            break
        time.sleep(0.05)
    assert health["queue"] == {"waiting": 2, "running": 1}
    fake.gate.set()
    for t in threads:
        t.join(30)
    assert results == {n: f"Reply {i} to: {n}" for i, n in enumerate(("one", "two", "three"), 1)}
    snap = state.log.snapshot()
    assert (snap.waiting, snap.running, snap.total) == (0, 0, 3)
    assert [r.client for r in snap.records] == ["127.0.0.1 one", "127.0.0.1 two", "127.0.0.1 three"]
    assert all(r.status == "done" for r in snap.records)


def test_full_queue_is_refused_with_503():
    engine = TrackedEngine(FakeEngine(), RequestLog())
    state = ServeState(engine, max_queue=0)
    with ServerThread(create_app(state)) as server:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    engine.close()


# ---------------------------------------------------------------- pure parts


def test_reply_memory_finds_ids_after_reasoning_was_removed():
    tok = FakeTokenizer()
    text = "<think>plan it</think>\n\nThe answer."
    ids = tok.char_ids(text) + [END_ID]
    memory = ReplyMemory(max_entries=8)
    memory.remember(tok, text, ids)
    assert memory.lookup(text) == tuple(ids)
    stripped = memory.lookup("The answer.")
    assert stripped is not None and tok.decode(stripped, skip_special_tokens=True) == "The answer."
    assert (
        tok.decode(memory.lookup("\n\nThe answer."), skip_special_tokens=True) == "\n\nThe answer."
    )
    assert memory.lookup("the answer.") is None
    for i in range(10):
        memory.remember(tok, f"reply {i}", tok.char_ids(f"reply {i}"))
    assert len(memory) == 8 and memory.lookup(text) is None


def test_sampling_parameters_follow_openai_names():
    """A body's sampling over the server's defaults, as one ``SamplingParams``; its ranges
    are the 400s, naming the body's own field."""
    defaults = SamplingParams(max_tokens=100)
    body = {"max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3}
    s = sampling(body, defaults)
    assert (s.max_tokens, s.temperature, s.top_p, s.seed) == (7, 0.5, 0.9, 3)
    assert sampling({}, defaults) == defaults
    assert sampling({"stop": "END", "top_p": 0}, defaults).stop == ("END",)  # top_p 0: off
    for body, param in (
        ({"top_p": 2}, "top_p"),
        ({"stop": [1]}, "stop"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"repetition_context_size": 0}, "repetition_context_size"),
    ):
        with pytest.raises(APIError) as e:
            sampling(body, defaults)
        assert (e.value.status, e.value.param) == (400, param)


def test_sampling_controls_reach_the_request_under_openai_and_mlx_lm_names(served):
    """OpenAI's ``top_p``, ``presence_penalty``, ``frequency_penalty`` and mlx_lm.server's
    ``top_k``, ``min_p``, ``repetition_penalty`` reach the engine's request; bad values
    are a 400 naming the field."""
    state, url = served
    c = client(url)
    c.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.2},
    )
    req = state.engine.engine.requests[-1]
    got = (req.sampling.top_p, req.sampling.presence_penalty, req.sampling.frequency_penalty)
    assert got == (0.9, 0.5, -0.25)
    assert (req.sampling.top_k, req.sampling.min_p, req.sampling.repetition_penalty) == (
        40,
        0.05,
        1.2,
    )
    for bad in ({"top_k": -1}, {"min_p": 1.5}, {"repetition_penalty": 0}, {"presence_penalty": 3}):
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "hi"}], extra_body=bad
            )
        assert err.value.body["param"] == next(iter(bad))


def test_reply_memory_persists_and_compacts_its_file(tmp_path):
    tok = FakeTokenizer()
    path = tmp_path / "replies" / "m.jsonl"
    memory = ReplyMemory(max_entries=3, path=path)
    for i in range(7):
        memory.remember(tok, f"reply {i}", tok.char_ids(f"reply {i}"))
    assert len(path.read_text().splitlines()) <= 6  # compacted past twice max_entries
    with open(path, "a") as f:
        f.write("not json\n")
    again = ReplyMemory(max_entries=3, path=path)
    assert [again.lookup(f"reply {i}") is not None for i in range(7)] == [False] * 4 + [True] * 3
    assert again.lookup("reply 6") == tuple(tok.char_ids("reply 6"))
    unwritable = ReplyMemory(max_entries=3, path=tmp_path / "f" / "x.jsonl")
    (tmp_path / "f").write_text("a file where a folder should be")
    unwritable.remember(tok, "still kept", [1, 2])  # in RAM only (the file tried again later)
    assert unwritable.lookup("still kept") == (1, 2) and not path.with_name("x.jsonl").exists()


def test_a_reply_cut_at_a_stop_string_is_logged_done(served):
    state, url = served
    client(url).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x STOP"}], stop="STOP"
    )
    (record,) = state.log.snapshot().records
    assert (record.status, record.metrics.finish_reason) == ("done", "stop")


def test_cli_refuses_a_remote_bind_without_flag_and_key(isolated_settings, monkeypatch, capsys):
    from tierchat.cli.main import main

    monkeypatch.delenv("TIERCHAT_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--model", "tiny:llama"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    assert main(["serve", "--host", "0.0.0.0", "--allow-remote", "--model", "tiny:llama"]) == 2
    assert "API key" in capsys.readouterr().err
