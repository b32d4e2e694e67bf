"""The pure parts of ``tierchat bench --agent``: the floor's prefill curve, new tokens, the
summary, copies of a session told apart, reading the three streams' usage. No model."""

from __future__ import annotations

import json

import pytest
from tierchat.cli.bench.agent_bench import _first_output, calibration_lengths, read_usage
from tierchat.cli.bench.agent_report import (
    AgentRequest,
    PrefillCurve,
    ServerRun,
    fit_prefill_curve,
    new_tokens,
    ratios,
    request_table,
    summarize,
)
from tierchat.cli.bench.agent_sessions import (
    LONG_SESSION_NAMES,
    RecordedRequest,
    load_session,
    with_suffix,
)


def test_fit_recovers_a_quadratic_and_the_floor_is_the_marginal_cost():
    truth = PrefillCurve(0.05, 2e-4, 3e-9)
    points = [(n, truth.cold_s(n)) for n in (1000, 4000, 16000, 64000)]
    got = fit_prefill_curve(points)
    for a, b in ((got.c0, truth.c0), (got.c1, truth.c1), (got.c2, truth.c2)):
        assert a == pytest.approx(b, rel=1e-6)
    # all new: the cold time; none new: the fixed cost; in between: T(L) - T(L-k) + c0
    assert got.floor_s(64000, 64000) == pytest.approx(truth.cold_s(64000))
    assert got.floor_s(64000, 0) == pytest.approx(truth.c0)
    k = 2000
    want = truth.c0 + truth.cold_s(64000) - truth.cold_s(64000 - k)
    assert got.floor_s(64000, k) == pytest.approx(want)
    # the same new tokens cost more deeper in the context (attention)
    assert got.floor_s(64000, k) > got.floor_s(8000, k)


def test_fit_keeps_coefficients_non_negative():
    # falling per-token cost (a noisy start) would fit c2 < 0: refit without it
    points = [(1000, 1.0), (2000, 1.9), (4000, 3.5)]
    got = fit_prefill_curve(points)
    assert min(got.c0, got.c1, got.c2) >= 0
    assert got.cold_s(4000) == pytest.approx(3.5, rel=0.1)
    one = fit_prefill_curve([(1000, 2.0)])  # one point: a line through the origin
    assert (one.c0, one.c1, one.c2) == (0.0, 0.002, 0.0)
    with pytest.raises(ValueError):
        fit_prefill_curve([])
    with pytest.raises(ValueError):
        fit_prefill_curve([(0, 1.0)])


def test_new_tokens_counts_after_the_common_prefix_with_the_request_before():
    prompts = [[1, 2, 3], [1, 2, 3, 9, 4, 5], [1, 2, 7, 7], [1, 2, 7, 7]]
    # the first: all; then after [1,2,3]; an edit at position 2; an exact repeat: none
    assert new_tokens(prompts) == [3, 3, 2, 0]


def test_calibration_lengths_span_short_to_longest_evenly_in_log_n():
    assert calibration_lengths(70000, 4) == [256, 1662, 10785, 70000]
    assert calibration_lengths(97350, 3) == [256, 4992, 97350]
    assert calibration_lengths(100, 4) == [100]  # shorter than the shortest: one point
    assert calibration_lengths(300, 4) == [300]  # closer than 64 tokens: merged


def test_floor_of_a_short_turn_deep_in_a_long_context_from_noisy_cold_points():
    # an 8B-like GPU curve; the measured cold points off by a few per cent either way
    truth = PrefillCurve(0.04, 8e-5, 2.5e-9)
    noise = (1.04, 0.97, 1.03, 0.96)
    points = [
        (n, truth.cold_s(n) * f) for n, f in zip(calibration_lengths(97350, 4), noise, strict=True)
    ]
    got = fit_prefill_curve(points)
    # a 184-token turn at 11.8K (the fixed and per-token costs dominate) and two ~8K-token
    # turns deep in the context (attention dominates): each within 10% of the truth
    for context, new in ((11849, 184), (66813, 9046), (97350, 6700)):
        assert got.floor_s(context, new) == pytest.approx(truth.floor_s(context, new), rel=0.1)


def row(server, index, ttft, phase="before", copy=0, floor=None, cold=None, cached=0):
    return AgentRequest(
        server, "s", copy, index, phase, "chat", 1000 + index, cached, 100, 4,
        float(index), ttft, ttft + 0.1, floor, cold, None,
    )  # fmt: skip


def test_summary_names_the_worst_request_and_the_restart():
    run = ServerRun("tierchat", wall_s=2.0)
    run.requests = [
        row("tierchat", 0, 5.0, floor=5.0, cold=5.0),
        row("tierchat", 1, 0.3, floor=0.2, cold=5.1, cached=1000),
        row("tierchat", 2, 0.6, phase="after", floor=0.3, cold=6.0, cached=990),
        row("tierchat", 3, 0.2, phase="after", floor=0.2, cold=6.1, cached=1003),
    ]
    s = summarize(run)
    assert s["ttft_worst_s"] == 5.0 and s["ttft_worst_request"] == "s#0 copy 0"
    assert s["ttft_median_s"] == pytest.approx(0.45)
    assert s["over_floor_worst"] == pytest.approx(2.0)  # request 2: 0.6 / 0.3
    assert s["over_floor_worst_request"] == "s#2 copy 0"
    assert s["restart"]["index"] == 2
    assert s["restart"]["cached_share"] == pytest.approx(990 / 1002)
    assert s["restart"]["over_cold"] == pytest.approx(0.1)
    assert s["tokens_per_s"] == pytest.approx(16 / 2.0)
    table = request_table(run, None)
    assert "s#2*" in table and "s#3*" not in table  # the first request after the restart


def test_a_peer_that_failed_midway_is_compared_on_the_requests_it_answered():
    """mlx_lm.server out of GPU memory at a long prompt: its rows so far stay, and the
    ratios are over the requests both servers answered (tierchat's later, longer requests
    would otherwise weigh on its side alone); no tokens/s ratio."""
    ours = ServerRun("tierchat", wall_s=10.0)
    ours.requests = [row("tierchat", i, t) for i, t in enumerate((1.0, 0.2, 0.4, 9.0, 8.0))]
    theirs = ServerRun("mlx-lm", wall_s=4.0, failure="out of memory")
    theirs.requests = [row("mlx-lm", i, t) for i, t in enumerate((4.0, 0.4, 2.0))]
    r = ratios(ours, theirs)
    assert r["requests"] == 3 and r["tokens_per_s"] is None
    assert r["ttft_median"] == pytest.approx(0.4 / 2.0)
    assert r["ttft_worst"] == pytest.approx(1.0 / 4.0)
    theirs.failure = ""  # a whole run: every request of both, and tokens/s
    assert ratios(ours, theirs)["ttft_worst"] == pytest.approx(9.0 / 4.0)
    assert ratios(ours, theirs)["tokens_per_s"] is not None


def test_copies_differ_after_the_first_user_message_only():
    session = load_session("claude-code")
    first = session[0]
    a, b = with_suffix(first, " (sub-agent 1)"), with_suffix(first, " (sub-agent 2)")
    assert with_suffix(first, "") is first
    # system prompt and tools shared; the first user message differs only in its end
    assert a.body["system"] == b.body["system"] == first.body["system"]
    assert a.body["tools"] == b.body["tools"] == first.body["tools"]
    ua, ub = json.dumps(a.body["messages"][0]), json.dumps(b.body["messages"][0])
    assert ua != ub and ua.replace("sub-agent 1", "sub-agent 2") == ub
    assert a.body["messages"][1:] == first.body["messages"][1:]
    assert first.body == load_session("claude-code")[0].body  # the original untouched
    chat = RecordedRequest(
        "chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert with_suffix(chat, "!").body["messages"][0]["content"] == "hi!"
    items = [{"role": "user", "content": [{"type": "input_text", "text": "go"}]}]
    resp = with_suffix(RecordedRequest("responses", "/v1/responses", {"input": items}), "!")
    assert resp.body["input"][0]["content"][0]["text"] == "go!"
    with pytest.raises(ValueError):
        with_suffix(RecordedRequest("chat", "/", {"messages": [{"role": "system"}]}), "x")


@pytest.mark.parametrize("name", LONG_SESSION_NAMES)
def test_the_long_session_grows_past_64k_tokens_worth_of_text(name):
    requests = load_session(name)
    assert all(r.has_tools for r in requests)
    sizes = [len(json.dumps(r.body)) for r in requests]
    assert sizes == sorted(sizes) and sizes[-1] > 4 * 64_000  # ~4 characters a token


def test_usage_and_first_output_of_each_stream():
    seen: dict = {}
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 50}}}
    read_usage("messages", start, seen)
    assert seen == {}  # the final counts come with message_delta
    delta = {
        "type": "message_delta",
        "usage": {"input_tokens": 10, "cache_read_input_tokens": 40, "output_tokens": 3},
    }
    read_usage("messages", delta, seen)
    assert seen == {"prompt": 50, "cached": 40, "completion": 3}
    done = {
        "type": "response.completed",
        "response": {
            "usage": {
                "input_tokens": 70,
                "input_tokens_details": {"cached_tokens": 64},
                "output_tokens": 2,
            }
        },
    }
    read_usage("responses", done, seen)
    assert seen == {"prompt": 70, "cached": 64, "completion": 2}
    chunk = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}
    read_usage("chat", chunk, seen)
    assert seen == {"prompt": 9, "cached": 0, "completion": 1}
    assert _first_output("messages", {"type": "content_block_delta"})
    assert not _first_output("messages", {"type": "ping"})
    assert _first_output("responses", {"type": "response.function_call_arguments.delta"})
    assert not _first_output("responses", {"type": "response.created"})
    assert _first_output("chat", {"choices": [{"delta": {"tool_calls": [{}]}}]})
    assert not _first_output("chat", {"choices": [{"delta": {"role": "assistant", "content": ""}}]})
