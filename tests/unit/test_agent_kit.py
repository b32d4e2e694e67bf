"""The agent-CLI harness's reading of replies (tests/agent_kit.py): which replies ended, and
the cache check over a session with a stream the client gave up on. No server."""

from __future__ import annotations

import json

from agent_kit import Exchange, cache_shortfalls


def sse(*events: dict) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def start(prompt: int, cached: int = 0) -> dict:
    usage = {"input_tokens": prompt - cached, "cache_read_input_tokens": cached}
    return {"type": "message_start", "message": {"usage": {**usage, "output_tokens": 0}}}


def ends(output: int) -> tuple[dict, ...]:
    return (
        {"type": "message_delta", "usage": {"output_tokens": output}},
        {"type": "message_stop"},
    )


def exchange(seq: int, reply: bytes, stream: bool = True) -> Exchange:
    body = {"tools": [{"name": "Read"}], "stream": stream}
    return Exchange(seq, "/v1/messages?beta=true", body, 200, reply)


def test_ended_by_each_wire():
    assert exchange(0, sse(start(100), *ends(5))).ended
    assert not exchange(0, sse(start(100), {"type": "ping"})).ended  # the client left
    assert exchange(0, b'{"type": "message", "usage": {"input_tokens": 3}}', False).ended
    done = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    assert Exchange(0, "/v1/chat/completions", {}, 200, done).ended
    assert not Exchange(0, "/v1/chat/completions", {}, 200, done[:20]).ended
    completed = sse({"type": "response.created"}, {"type": "response.completed"})
    assert Exchange(0, "/v1/responses", {}, 200, completed).ended
    cut = sse({"type": "response.created"}, {"type": "keepalive"})
    assert not Exchange(0, "/v1/responses", {}, 200, cut).ended


def test_a_stream_given_up_on_is_passed_over_and_the_next_is_held_to_the_last_ended():
    # Claude Code's first stream cut during its prefill, the same request again without
    # streaming (the prefix the cancelled prefill kept), then the tool result
    session = [
        exchange(0, sse(start(11660), {"type": "ping"})),
        exchange(
            1,
            json.dumps(
                {
                    "type": "message",
                    "usage": {
                        "input_tokens": 140,
                        "cache_read_input_tokens": 11520,
                        "output_tokens": 30,
                    },
                }
            ).encode(),
            stream=False,
        ),
        exchange(2, sse(start(11734, cached=11660), *ends(18))),
    ]
    assert cache_shortfalls(session) == []
    # the same session whose third request missed the cache: still caught
    session[2] = exchange(2, sse(start(11734, cached=512), *ends(18)))
    (problem,) = cache_shortfalls(session)
    assert problem.startswith("main request 1: cached 512 < 11630")
