"""The recorded agent sessions (``cli/workloads/agent-*.jsonl``: Claude Code over Anthropic
Messages, Codex CLI over Responses, OpenCode over chat completions) replayed on a real
engine (``tiny:qwen2``, 131,072-token context) through their own API, then the same
conversations through ``/v1/chat/completions``:

- every main request (one offering tools) after the first restores at least 95% of the
  previous main request's prompt from the cache (the recorded replies are a script's, so
  only the prompt, not the reply, can be a prefix of the next one);
- the same conversation through the other API gives the same prompt token ids.

The prompts are 30K-50K tokens on the tiny character-level tokenizer: the first request
of each session is a cold prefill of minutes on a CPU; the rest are fast.
"""

from __future__ import annotations

import httpx
import pytest
from engine_kit import ScriptedEngine, make_engine
from tierchat.cli.bench.agent_sessions import (
    SESSION_NAMES,
    as_chat_body,
    load_session,
    replay_body,
)
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.app import create_app
from tierchat.core.serve.log import RequestLog, TrackedEngine
from tierchat.core.serve.server import ServerThread
from tierchat.core.serve.state import ServeState

pytestmark = [pytest.mark.system, pytest.mark.slow]

MAX_TOKENS = 4
RESTORED = 0.95


def prompt_and_cached(api: str, reply: dict) -> tuple[int, int]:
    """``(prompt tokens, cached tokens)`` in the API's own usage fields."""
    u = reply["usage"]
    if api == "messages":
        cached = u["cache_read_input_tokens"]
        return u["input_tokens"] + cached, cached
    if api == "responses":
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("name", SESSION_NAMES)
def test_recorded_session_restores_each_prompt_and_matches_chat(name, tmp_path, models_dir):
    session = load_session(name)
    engine = ScriptedEngine(make_engine("tiny:qwen2", tmp_path, models_dir))
    state = ServeState(
        TrackedEngine(engine, RequestLog()), sampling=SamplingParams(max_tokens=MAX_TOKENS)
    )
    server = ServerThread(create_app(state)).start()
    try:
        native: list[tuple[int, ...]] = []
        previous = None
        for i, recorded in enumerate(session):
            body = replay_body(recorded, MAX_TOKENS)
            r = httpx.post(server.url + recorded.path, json=body, timeout=1800)
            assert r.status_code == 200, (i, r.text[:500])
            native.append(engine.requests[-1].prompt_ids)
            if not recorded.has_tools:
                continue
            prompt, cached = prompt_and_cached(recorded.api, r.json())
            assert prompt == len(native[-1])
            if previous is not None:
                assert cached >= RESTORED * previous, (i, cached, previous)
            previous = prompt
        # the same conversations through chat completions: the same ids, all restored
        for i, recorded in enumerate(session):
            body = as_chat_body(recorded, state, MAX_TOKENS)
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1800)
            assert r.status_code == 200, (i, r.text[:500])
            assert engine.requests[-1].prompt_ids == native[i], i
    finally:
        server.stop()
        engine.close()
