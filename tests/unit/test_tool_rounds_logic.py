"""Tool rounds, the pure part (core/chat/tool_rounds_logic.py): replies split by the family parser
serve uses, calls resolved against the conversation's tools (unknown tools and unreadable
arguments become error results), function names, the round limit."""

from __future__ import annotations

import json

from tierchat.core.chat.tool_calls import ReplyFormat
from tierchat.core.chat.tool_rounds_logic import next_step, plan_calls, reply_meta, split_reply
from tierchat.core.tools.mcp_host import ToolInfo, function_names

HERMES = ReplyFormat.named("json_tools", None)
READ = ToolInfo("fs", "read_file", "read_file", "Read a file", {"type": "object"})
ECHO = ToolInfo("kit", "echo", "echo", "Echo", {"type": "object"})
SPECS = [READ.spec(), ECHO.spec()]


def test_a_reply_with_a_call_is_split_into_text_and_the_openai_call():
    text = 'Let me look.<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'
    split = split_reply(HERMES, text, SPECS)
    assert split.content == "Let me look."
    (call,) = split.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "read_file"
    assert json.loads(call["function"]["arguments"]) == {"path": "a.txt"}
    assert not split.unreadable


def test_a_reply_without_calls_keeps_its_text_and_stores_nothing_more():
    assert reply_meta(HERMES, "Just an answer.", SPECS) == {}


def test_unreadable_arguments_become_a_call_with_an_error_and_leave_the_text():
    text = 'Hm.<tool_call>\n{"name": "read_file", "arguments": {"path": \n</tool_call>'
    meta = reply_meta(HERMES, text, SPECS)
    assert meta["content"] == "Hm."
    (call,) = meta["tool_calls"]
    assert call["function"]["name"] == "read_file"
    assert call["id"] in meta["tool_call_errors"]
    (planned,) = plan_calls(meta["tool_calls"], [READ], meta["tool_call_errors"])
    assert planned.tool is None and "JSON object" in planned.error


def test_a_reply_cut_inside_a_call_is_text_until_continued():
    text = 'Hm.<tool_call>\n{"name": "read_file", "arguments": {"pa'
    assert reply_meta(HERMES, text, SPECS, cut=True) == {}  # the stored text is all of it
    assert split_reply(HERMES, text, SPECS, cut=True).content == text
    # a reply that ended (not cut) there made an unreadable call; so does a cut one whose
    # call was closed
    assert reply_meta(HERMES, text, SPECS)["tool_call_errors"]
    closed = 'Hm.<tool_call>\n{"name": "read_file", "arguments": {"pa\n</tool_call>'
    assert reply_meta(HERMES, closed, SPECS, cut=True)["tool_call_errors"]


def test_bare_calls_keep_the_reply_as_written_and_marked_ones_do_not():
    bare = '{"name": "read_file", "arguments": {"path": "a.txt"}}'
    for text in (bare, f"```json\n{bare}\n```", f"\n{bare}\n"):
        meta = reply_meta(HERMES, text, SPECS)
        assert meta["content"] == "" and meta["as_written"] == text
        assert meta["tool_calls"][0]["function"]["name"] == "read_file"
    marked = f"<tool_call>\n{bare}\n</tool_call>"
    assert "as_written" not in reply_meta(HERMES, marked, SPECS)


def test_calls_resolve_by_function_name_and_unknown_tools_say_which_there_are():
    calls = [
        {"id": "a", "function": {"name": "read_file", "arguments": '{"path": "x"}'}},
        {"id": "b", "function": {"name": "write_file", "arguments": "{}"}},
        {"id": "c", "function": {"name": "echo", "arguments": "[1]"}},
        {"id": "d", "function": {"name": "echo", "arguments": "{not json"}},
    ]
    a, b, c, d = plan_calls(calls, [READ, ECHO])
    assert a.tool == READ and a.arguments == {"path": "x"} and not a.error
    assert (
        b.tool is None and "no tool named 'write_file'" in b.error and "echo, read_file" in b.error
    )
    assert c.tool is None and "JSON object" in c.error
    assert d.tool is None and "not valid JSON" in d.error


def test_function_names_are_the_tools_own_unless_two_servers_share_one():
    pairs = [("fs", "read_file"), ("kit", "echo"), ("other.srv", "echo"), ("kit", "a b")]
    assert function_names(pairs) == ["read_file", "kit__echo", "other_srv__echo", "a_b"]


def test_the_round_limit():
    assert next_step(0, 1, 8) == "done"
    assert next_step(2, 8, 8) == "run"
    assert next_step(1, 9, 8) == "limit"
