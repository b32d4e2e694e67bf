"""Anthropic Messages bodies -> the internal request (core/serve/anthropic_api.py), and the
system line filters every API shares (core/serve/request.py normalize_system). No model,
no server: the same conversation in each of its JSON forms must give the same messages."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.anthropic_api import chat_request, error_body, stop_reason
from tierchat.core.serve.prompts import APIError
from tierchat.core.serve.request import normalize_system
from tierchat.core.serve.state import SYSTEM_LINE_FILTERS

STATE = SimpleNamespace(sampling=SamplingParams())
TOOL = {
    "name": "read_file",
    "description": "Read a file.",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}


def convert(**body):
    return chat_request({"max_tokens": 100, **body}, STATE)


def conversation(blocks: bool, cache_control: bool):
    """One conversation with a tool round trip, as strings or as blocks, with or without
    cache_control markers."""
    cc = {"cache_control": {"type": "ephemeral"}} if cache_control else {}

    def text(t):
        return [{"type": "text", "text": t, **cc}] if blocks else t

    result = {"type": "tool_result", "tool_use_id": "toolu_1", **cc}
    result["content"] = [{"type": "text", "text": "hello", **cc}] if blocks else "hello"
    return {
        "system": text("Be brief."),
        "messages": [
            {"role": "user", "content": text("Read notes.txt")},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Reading."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "read_file",
                        "input": {"path": "notes.txt"},
                        **cc,
                    },
                ],
            },
            {"role": "user", "content": [result]},
            {"role": "assistant", "content": text("It says hello.")},
        ],
        "tools": [{**TOOL, **cc}],
    }


def test_the_json_forms_of_one_conversation_give_the_same_messages():
    forms = [convert(**conversation(b, c)).messages for b in (False, True) for c in (False, True)]
    assert all(f == forms[0] for f in forms)
    assert forms[0] == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Read notes.txt"},
        {
            "role": "assistant",
            "content": "Reading.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "hello"},
        {"role": "assistant", "content": "It says hello."},
    )


def test_system_blocks_and_text_blocks_join_with_a_blank_line():
    chat = convert(
        system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
            }
        ],
    )
    assert chat.messages == (
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "x\n\ny"},
    )


def test_tool_results_come_first_in_order_then_the_text_and_errors_are_marked():
    chat = convert(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and now?"},
                    {"type": "tool_result", "tool_use_id": "a", "content": "one"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "b",
                        "content": "no such file",
                        "is_error": True,
                    },
                ],
            }
        ]
    )
    assert chat.messages == (
        {"role": "tool", "tool_call_id": "a", "content": "one"},
        {"role": "tool", "tool_call_id": "b", "content": "Error: no such file"},
        {"role": "user", "content": "and now?"},
    )


def test_thinking_is_reasoning_redacted_thinking_is_dropped_system_turns_stay_in_place():
    chat = convert(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "they greet", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "text", "text": "hello"},
                ],
            },
        ]
    )
    assert chat.messages[1:] == (
        {"role": "system", "content": "# Environment"},
        {"role": "assistant", "content": "hello", "reasoning_content": "they greet"},
    )


@pytest.mark.parametrize("kind", ["image", "document"])
def test_images_and_documents_are_a_400_that_names_them(kind):
    block = {"type": kind, "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    for content in ([block], [{"type": "tool_result", "tool_use_id": "a", "content": [block]}]):
        with pytest.raises(APIError) as e:
            convert(messages=[{"role": "user", "content": content}])
        assert e.value.status == 400 and "images" in e.value.message


def test_tools_tool_choice_and_server_tools(capsys):
    server_tool = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    chat = convert(messages=[{"role": "user", "content": "x"}], tools=[TOOL, server_tool])
    assert chat.tools == (
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file.",
                "parameters": TOOL["input_schema"],
            },
        },
    )
    assert "web_search_20250305" in capsys.readouterr().err
    assert (chat.tool_choice, chat.forced_tool, chat.parallel_tool_calls) == ("auto", None, True)
    cases = {
        "auto": ("auto", None),
        "any": ("required", None),
        "none": ("none", None),
        "tool": ("required", "read_file"),
    }
    for kind, want in cases.items():
        choice = {"type": kind, "disable_parallel_tool_use": True}
        if kind == "tool":
            choice["name"] = "read_file"
        c = convert(messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice=choice)
        assert (c.tool_choice, c.forced_tool, c.parallel_tool_calls) == (*want, False)


def test_sampling_thinking_and_the_fields_that_are_accepted_and_ignored():
    chat = chat_request(
        {
            "model": "anything",
            "max_tokens": 32000,
            "messages": [{"role": "user", "content": "x"}],
            "stop_sequences": ["END"],
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "metadata": {"user_id": "u"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "output_config": {"effort": "high"},
            "service_tier": "auto",
            "container": "c",
            "mcp_servers": [],
            "stream": True,
        },
        STATE,
    )
    s = chat.sampling
    assert (s.max_tokens, s.stop, s.temperature, s.top_p, s.top_k, chat.stream) == (
        32000,
        ("END",),
        0.7,
        0.9,
        40,
        True,
    )
    assert chat.clamp_max_tokens and chat.enable_thinking is True
    for kind, want in (("adaptive", None), ("disabled", False)):
        assert (
            convert(
                messages=[{"role": "user", "content": "x"}], thinking={"type": kind}
            ).enable_thinking
            is want
        )


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": None},
        {"temperature": 6},  # SamplingParams' range, 0..5
        {"top_p": -0.1},
        {"messages": []},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"stop_sequences": "END"},
        {"thinking": {"type": "sometimes"}},
        {"tool_choice": {"type": "tool"}},
    ],
)
def test_bad_bodies_are_400s(change):
    body = {
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [TOOL],
        **change,
    }
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(APIError) as e:
        chat_request(body, STATE)
    assert e.value.status == 400


def test_count_tokens_bodies_need_no_max_tokens():
    chat = chat_request({"messages": [{"role": "user", "content": "x"}]}, STATE, count_only=True)
    assert chat.messages == ({"role": "user", "content": "x"},)


def test_errors_in_anthropic_shape_by_status():
    cases = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        503: "overloaded_error",
    }
    for status, kind in cases.items():
        body = error_body(APIError("why", status))
        assert body == {"type": "error", "error": {"type": kind, "message": "why"}}


def test_stop_reasons():
    def end(reason, seq=None):
        return SimpleNamespace(finish_reason=reason, stop_sequence=seq)

    assert stop_reason(end("tool_calls")) == "tool_use"
    assert stop_reason(end("length")) == "max_tokens"
    assert stop_reason(end("stop", "END")) == "stop_sequence"
    assert stop_reason(end("stop")) == "end_turn"


def test_the_billing_header_line_is_removed_from_system_messages_only():
    billing = "x-anthropic-billing-header: cc_version=2.1.328.acd; cc_entrypoint=sdk-cli;"
    system = f"{billing}\n\nYou are a Claude agent.\nkeep: x-anthropic-billing-header: here"
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": billing},
        {"role": "system", "content": "no header"},
    ]
    original = copy.deepcopy(messages)
    out = normalize_system(messages, SYSTEM_LINE_FILTERS)
    assert out == [
        {
            "role": "system",
            "content": "You are a Claude agent.\nkeep: x-anthropic-billing-header: here",
        },
        messages[1],
        messages[2],
    ]
    assert messages == original  # not changed in place
    other = system.replace("2.1.328.acd", "2.2.0.xyz")
    assert normalize_system([{"role": "system", "content": other}], SYSTEM_LINE_FILTERS) == out[:1]
    assert normalize_system(messages, ()) == messages


def test_system_blocks_of_claude_code_normalize_to_the_text_without_the_header():
    chat = convert(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=ab12;"},
            {
                "type": "text",
                "text": "You are a Claude agent.",
                "cache_control": {"type": "ephemeral"},
            },
        ],
        messages=[{"role": "user", "content": "x"}],
    )
    out = normalize_system(chat.messages, SYSTEM_LINE_FILTERS)
    assert out[0] == {"role": "system", "content": "You are a Claude agent."}
