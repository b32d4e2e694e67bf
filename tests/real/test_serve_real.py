"""``tierchat serve`` on the real engine (tiny models), driven by the official ``openai``
client over 127.0.0.1: cached tokens growing turn by turn, two clients interleaved, a
restart served from the SSD tier, and regenerate on a hybrid prefilling one token."""

from __future__ import annotations

import threading
from pathlib import Path

import openai
import pytest
from engine_kit import make_engine
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.app import create_app
from tierchat.core.serve.log import RequestLog, TrackedEngine
from tierchat.core.serve.server import ServerThread
from tierchat.core.serve.state import ServeState

MAX_TOKENS = 8
WORDS = "the quick brown fox jumps over a lazy dog while seven ships sail past".split()


def user_text(i: int, name: str = "") -> str:
    words = [WORDS[(i * 3 + k) % len(WORDS)] for k in range(20)]
    return f"{name} question {i}: " + " ".join(words)


class Served:
    """A real engine on ``model`` behind a server on a free loopback port (its reply
    memory kept under ``tmp`` when ``persist``)."""

    def __init__(self, model: str, tmp: Path, models_dir: Path, persist: bool = False, **kw):
        self.engine = TrackedEngine(make_engine(model, tmp, models_dir), RequestLog())
        path = tmp / "replies.jsonl" if persist else None
        kw.setdefault("sampling", SamplingParams(max_tokens=MAX_TOKENS))
        self.state = ServeState(self.engine, memory_path=path, **kw)
        self.server = ServerThread(create_app(self.state)).start()
        self.client = openai.OpenAI(
            base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=120
        )

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture
def llama(tmp_path, models_dir):
    served = Served("tiny:llama", tmp_path, models_dir)
    yield served
    served.close()


def chat(client: openai.OpenAI, messages: list[dict], stream: bool = False, **kw):
    """One turn; returns (text, usage). Streams with include_usage when ``stream``."""
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=messages, **kw)
        return r.choices[0].message.content, r.usage
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


def test_cached_tokens_grow_turn_by_turn_streaming_and_not(llama):
    messages = [{"role": "system", "content": "You answer in one line."}]
    previous = None
    for turn in range(3):
        messages.append({"role": "user", "content": user_text(turn)})
        text, usage = chat(llama.client, messages, stream=turn % 2 == 1)
        cached = usage.prompt_tokens_details.cached_tokens
        extra = usage.model_extra["tierchat"]
        assert extra["prefill_tokens"] == usage.prompt_tokens - cached
        assert sum(extra["cached_by"].values()) == cached
        if previous is None:
            assert cached == 0
        else:
            # the previous prompt and its reply's generated ids (from the reply memory: its
            # text re-tokenizes to other ids) are reused; an EOS the template replaces may not
            assert cached >= previous.prompt_tokens + previous.completion_tokens - 1
            assert extra["prefill_tokens"] < len(user_text(turn)) + 16
        previous = usage
        messages.append({"role": "assistant", "content": text})
    snap = llama.state.log.snapshot()
    assert [r.status for r in snap.records] == ["done"] * 3
    assert snap.records[-1].metrics.cached_tokens == previous.prompt_tokens_details.cached_tokens


def test_two_clients_interleaved_both_reuse_their_prefixes(llama):
    barrier = threading.Barrier(2)
    seen: dict[str, list] = {"alice": [], "bob": []}
    errors: list[BaseException] = []

    def converse(name: str) -> None:
        try:
            messages = [{"role": "system", "content": f"You are talking to {name}."}]
            for turn in range(3):
                barrier.wait(60)  # both clients send each turn together
                messages.append({"role": "user", "content": user_text(turn, name)})
                text, usage = chat(llama.client, messages, stream=name == "bob", user=name)
                seen[name].append(usage)
                messages.append({"role": "assistant", "content": text})
        except BaseException as e:  # noqa: BLE001 -- reported by the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=converse, args=(n,)) for n in seen]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for usages in seen.values():
        assert usages[0].prompt_tokens_details.cached_tokens < usages[0].prompt_tokens
        for before, after in zip(usages, usages[1:], strict=False):
            reused = before.prompt_tokens + before.completion_tokens - 1
            assert after.prompt_tokens_details.cached_tokens >= reused
    clients = [r.client.split()[-1] for r in llama.state.log.snapshot().records]
    # each turn both clients were queued together: the engine served them alternately
    assert [set(clients[i : i + 2]) for i in range(0, 6, 2)] == [{"alice", "bob"}] * 3


def test_a_restarted_server_serves_the_conversation_from_the_ssd_tier(tmp_path, models_dir):
    """The SSD tier's blocks are keyed by generated ids: the persisted reply memory lets the
    restarted server rebuild the same prompt, so all full blocks of turn 1's prompt and
    reply are found on disk."""
    # this reply's text re-tokenizes to other ids from its 4th token on
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": user_text(1)},
    ]
    served = Served(
        "tiny:llama", tmp_path, models_dir, persist=True, sampling=SamplingParams(max_tokens=24)
    )
    try:
        text, first = chat(served.client, messages)
    finally:
        served.close()
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again?"}]
    served = Served(
        "tiny:llama", tmp_path, models_dir, persist=True, sampling=SamplingParams(max_tokens=24)
    )
    try:
        _, after = chat(served.client, messages)
    finally:
        served.close()
    by = after.model_extra["tierchat"]["cached_by"]
    sequence = first.prompt_tokens + first.completion_tokens
    assert first.completion_tokens == 24
    assert by["ssd"] >= sequence // 16 * 16
    assert after.prompt_tokens_details.cached_tokens >= by["ssd"]


def test_regenerate_on_a_hybrid_prefills_one_token(tmp_path, models_dir):
    served = Served("tiny:qwen3_5", tmp_path, models_dir)
    try:
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": user_text(1)},
        ]
        _, first = chat(served.client, messages)
        _, again = chat(served.client, messages, stream=True)  # "regenerate"
    finally:
        served.close()
    assert first.prompt_tokens == again.prompt_tokens
    assert again.model_extra["tierchat"]["prefill_tokens"] == 1
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens - 1
