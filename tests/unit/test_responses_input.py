"""Responses API bodies -> the internal messages and tools (no HTTP, no model): the same
conversation as OpenAI chat messages gives the same internal messages."""

from __future__ import annotations

import pytest
from tierchat.core.serve.openai_api import chat_messages
from tierchat.core.serve.prompts import APIError
from tierchat.core.serve.responses_input import function_tools, to_messages, tool_choice

CALL = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "exec_command",
    "arguments": '{"cmd": "ls"}',
}
CALL2 = {**CALL, "call_id": "call_2", "arguments": '{"cmd": "pwd"}'}


def test_items_equal_the_chat_form_of_the_same_conversation():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": "List files."},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "use ls"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Sure."}],
        },
        CALL,
        CALL2,
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "/w"}],
        },
    ]
    chat = [
        {"role": "system", "content": "Rules."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "List files."},
        {
            "role": "assistant",
            "content": "Sure.",
            "reasoning_content": "use ls",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd": "pwd"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_2", "content": "/w"},
    ]
    assert to_messages(items, "Rules.") == chat_messages(chat)


def test_calls_without_an_assistant_message_open_one_and_reasoning_goes_to_it():
    items = [
        {"role": "user", "content": "hi"},
        {
            "type": "reasoning",
            "content": [{"type": "reasoning_text", "text": "think"}],
            "encrypted_content": "x",
        },
        {**CALL, "arguments": {"cmd": "ls"}},  # an object is written as JSON text
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
        CALL2,  # after a tool output: a new assistant turn
    ]
    msgs = to_messages(items)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[1]["content"] == "" and msgs[1]["reasoning_content"] == "think"
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"cmd": "ls"}'
    assert "reasoning_content" not in msgs[3]


@pytest.mark.parametrize(
    ("item", "says"),
    [
        ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input_image"),
        ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input_file"),
        ({"role": "tool", "content": "x"}, "role"),
        ({"type": "web_search_call", "id": "ws"}, "web_search_call"),
        ({"type": "function_call", "name": "f"}, "call_id"),
        ({"type": "function_call_output", "output": "x"}, "call_id"),
    ],
)
def test_unreadable_items_are_400s_naming_them(item, says):
    with pytest.raises(APIError) as e:
        to_messages([item])
    assert e.value.status == 400 and says in e.value.message
    assert e.value.param.startswith("input.0")


def test_function_tools_flat_form_and_other_tools_skipped():
    tools, skipped = function_tools(
        [
            {
                "type": "function",
                "name": "f",
                "description": "d",
                "parameters": {},
                "strict": False,
            },
            {"type": "web_search"},
            {"type": "local_shell"},
        ]
    )
    assert tools == (
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {}, "strict": False},
        },
    )
    assert skipped == ["web_search", "local_shell"]
    with pytest.raises(APIError):
        function_tools([{"type": "function", "name": "f"}, {"type": "function", "name": "f"}])


def test_tool_choice_forms():
    assert tool_choice(None) == ("auto", None)
    assert tool_choice("required") == ("required", None)
    assert tool_choice({"type": "function", "name": "f"}) == ("required", "f")
    with pytest.raises(APIError):
        tool_choice({"type": "web_search_preview"})
