"""Reply parsing over mlx-lm's tool parsers: recorded model outputs, one family each.

Each sample is a raw reply as the family's model writes it (the markers and call syntax
its mlx-lm ``tool_parsers`` module and chat template expect). Every sample is read whole
and fed one character at a time (same result), and its malformed variant becomes text plus
a ``ToolCallFailed``, never an exception.
"""

from __future__ import annotations

import json
import re
import sys
import types
from dataclasses import dataclass

import pytest
from tierchat.core.chat.tool_calls import (
    HeldCalls,
    ReasoningDelta,
    ReplyFormat,
    ReplyParser,
    TextDelta,
    ToolCallDelta,
    ToolCallFailed,
    parse_reply,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
PARIS = ("get_weather", {"city": "Paris", "days": 3})


@dataclass(frozen=True)
class Sample:
    family: str
    think: tuple[str, str] | None
    output: str  # a valid reply
    text: str  # its visible text
    reasoning: str
    calls: list[tuple[str, dict]]
    malformed: str  # a call the parser cannot read (the whole reply)
    in_reasoning: bool = False


SAMPLES = [
    Sample(  # Qwen2.5-Instruct (hermes-style JSON)
        "json_tools",
        None,
        "I'll look up the forecast.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "I'll look up the forecast.\n",
        "",
        [PARIS],
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
    ),
    Sample(  # Qwen3-Coder (XML parameters; types from the tool schema)
        "qwen3_coder",
        None,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "",
        "",
        [PARIS],
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
    ),
    Sample(  # GLM-4.7: the template opens <think>
        "glm47",
        ("<think>", "</think>"),
        "The user wants the Paris forecast for 3 days.</think>"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "",
        "The user wants the Paris forecast for 3 days.",
        [PARIS],
        "<tool_call><arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
        in_reasoning=True,
    ),
    Sample(  # Poolside Laguna: GLM-4.7's format under its own name
        "laguna",
        None,
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
        "",
        "",
        [PARIS],
        "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    ),
    Sample(  # MiniMax-M2: interleaved thinking, then the call
        "minimax_m2",
        ("<think>", "</think>"),
        "<think>\nI need the weather tool.\n</think>\n\n<minimax:tool_call>\n"
        '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
        "",
        "\nI need the weather tool.\n",
        [PARIS],
        '<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n</minimax:tool_call>',
    ),
    Sample(  # Kimi K2: one section, calls with "functions.<name>:<n>" ids
        "kimi_k2",
        ("<think>", "</think>"),
        "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        "Let me check.",
        "",
        [PARIS],
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
    ),
    Sample(  # Kimi K3 (XTML)
        "kimi_k3",
        ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
        "<|open|>think<|sep|>Weather lookup.<|close|>think<|sep|>"
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|>",
        "",
        "Weather lookup.",
        [PARIS],
        '<|open|>tools<|sep|><|open|>call index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|>",
    ),
    Sample(  # Mistral / Devstral: no end marker, read at finish
        "mistral",
        None,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        "",
        "",
        [PARIS],
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
    ),
    Sample(  # Gemma 4: <|"|> string delimiters, thought channel
        "gemma4",
        ("<|channel>thought", "<channel|>"),
        "<|channel>thought\nNeeds the forecast tool.<channel|>"
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
        "",
        "\nNeeds the forecast tool.",
        [PARIS],
        '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>',
    ),
    Sample(  # FunctionGemma
        "function_gemma",
        None,
        "<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}"
        "<end_function_call>",
        "",
        "",
        [PARIS],
        "<start_function_call>call:get_weather{city:<escape>Paris<end_function_call>",
    ),
    Sample(  # LFM2 (pythonic), text after the call
        "pythonic",
        None,
        '<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>'
        "Checking the forecast now.",
        "Checking the forecast now.",
        "",
        [PARIS],
        '<|tool_call_start|>[get_weather(city="Paris"<|tool_call_end|>',
    ),
    Sample(  # LongCat-Flash
        "longcat",
        ("<longcat_think>", "</longcat_think>"),
        "<longcat_tool_call>get_weather\n<longcat_arg_key>city</longcat_arg_key>\n"
        "<longcat_arg_value>Paris</longcat_arg_value>\n<longcat_arg_key>days</longcat_arg_key>\n"
        "<longcat_arg_value>3</longcat_arg_value>\n</longcat_tool_call>",
        "",
        "",
        [PARIS],
        "<longcat_tool_call>get_weather city=Paris</longcat_tool_call>",
    ),
    Sample(  # MiniCPM5: no outer wrapper
        "minicpm5",
        ("<think>", "</think>"),
        'Sure.\n<function name="get_weather"><param name="city">Paris</param>'
        '<param name="days">3</param></function>',
        "Sure.\n",
        "",
        [PARIS],
        "<function name=get_weather</function>",
    ),
    Sample(  # Muse Spark (XML_ATEM)
        "muse_spark",
        None,
        '<atem:function_calls><atem:invoke name="get_weather">'
        '<atem:parameter name="city">Paris</atem:parameter>'
        '<atem:parameter name="days">3</atem:parameter>'
        "</atem:invoke></atem:function_calls>",
        "",
        "",
        [PARIS],
        "<atem:function_calls><atem:invoke>get_weather Paris</atem:invoke></atem:function_calls>",
    ),
]
IDS = [s.family for s in SAMPLES]


def named_calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def fmt_of(sample: Sample) -> ReplyFormat:
    return ReplyFormat.named(sample.family, sample.think)


def stream(fmt: ReplyFormat, pieces, **kw):
    """Feed ``pieces`` one by one; (parser, every part in order)."""
    parser = ReplyParser(fmt, **kw)
    parts = []
    for piece in pieces:
        parts += parser.feed(piece)
    parts += parser.finish()
    return parser, parts


def joined(parts, kind) -> str:
    return "".join(p.text for p in parts if isinstance(p, kind))


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_recorded_call_is_read(sample):
    got = parse_reply(fmt_of(sample), sample.output, tools=TOOLS, in_reasoning=sample.in_reasoning)
    assert got.failures == []
    assert named_calls(got.calls) == sample.calls
    assert got.text == sample.text
    assert got.reasoning == sample.reasoning


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_recorded_call_streamed_one_char_at_a_time(sample):
    kw = dict(tools=TOOLS, in_reasoning=sample.in_reasoning)
    parser, parts = stream(fmt_of(sample), sample.output, **kw)
    whole = parse_reply(fmt_of(sample), sample.output, **kw)
    assert (parser.text, parser.reasoning) == (whole.text, whole.reasoning)
    assert named_calls(parser.calls) == named_calls(whole.calls) == sample.calls
    # the parts say the same as the totals
    assert joined(parts, TextDelta) == sample.text
    assert joined(parts, ReasoningDelta) == sample.reasoning
    deltas = [p for p in parts if isinstance(p, ToolCallDelta)]
    assert [d.index for d in deltas] == list(range(len(sample.calls)))
    assert [d.call for d in deltas] == parser.calls


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_malformed_call_is_text_and_a_failure(sample):
    fmt = fmt_of(sample)
    for pieces in ([sample.malformed], list(sample.malformed)):
        parser, parts = stream(fmt, pieces, tools=TOOLS)
        assert parser.calls == []
        assert parser.text == sample.malformed  # markers included
        assert joined(parts, TextDelta) == sample.malformed
        failures = [p for p in parts if isinstance(p, ToolCallFailed)]
        assert failures == parser.failures
        assert len(failures) == 1 and failures[0].raw == sample.malformed
        assert failures[0].error


def test_call_is_emitted_when_its_end_marker_arrives():
    parser = ReplyParser(ReplyFormat.named("json_tools"))
    assert parser.feed('<tool_call>{"name": "get_time", "arguments": {}}</tool_') == []
    (delta,) = parser.feed("call>")
    assert isinstance(delta, ToolCallDelta) and delta.call.name == "get_time"


def test_text_is_emitted_at_once_except_a_possible_marker():
    parser = ReplyParser(ReplyFormat.named("json_tools"))
    assert parser.feed("Hello <") == [TextDelta("Hello ")]
    assert parser.feed("b>bold <t") == [TextDelta("<b>bold ")]  # "<b" is no marker; "<t" may be
    assert parser.feed("d> <tool") == [TextDelta("<td> ")]
    assert parser.feed("_call>") == []
    assert parser.finish()[-1] == ToolCallFailed("<tool_call>", parser.failures[0].error)


def test_parallel_calls_and_text_before_them():
    out = (
        "I'll check both.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>'
    )
    got = parse_reply(ReplyFormat.named("json_tools"), out)
    assert got.text == "I'll check both.\n\n"  # the newline between calls is dropped
    assert named_calls(got.calls) == [PARIS, ("get_time", {"zone": "Europe/Paris"})]
    ids = [c.id for c in got.calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2


@pytest.mark.parametrize(
    "family,output",
    [
        (
            "kimi_k2",
            "<|tool_calls_section_begin|>"
            '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
            '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"zone": "UTC"}<|tool_call_end|>'
            "<|tool_calls_section_end|>",
        ),
        (
            "mistral",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
            '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
        ),
        (
            "pythonic",
            '<|tool_call_start|>[get_weather(city="Paris", days=3), get_time(zone="UTC")]<|tool_call_end|>',
        ),
    ],
)
def test_parallel_calls_in_one_block(family, output):
    fmt = ReplyFormat.named(family, None)
    parser, parts = stream(fmt, output)
    assert named_calls(parser.calls) == [PARIS, ("get_time", {"zone": "UTC"})]
    assert [p.index for p in parts if isinstance(p, ToolCallDelta)] == [0, 1]
    assert parser.text == ""


def test_reasoning_then_text_drops_leading_whitespace():
    got = parse_reply(ReplyFormat.named("json_tools"), "<think>\nHmm.\n</think>\n\nParis is sunny.")
    assert (got.reasoning, got.text) == ("\nHmm.\n", "Paris is sunny.")
    parser, parts = stream(ReplyFormat.named("json_tools"), ["<think>x</think>", "\n", "\n", "Hi"])
    assert parts == [ReasoningDelta("x"), TextDelta("Hi")]


def test_reply_without_think_block_is_all_text():
    got = parse_reply(ReplyFormat.named("json_tools"), "  Just an answer, no <thinking> here.")
    assert (got.text, got.reasoning) == ("  Just an answer, no <thinking> here.", "")
    no_think = ReplyFormat.named("json_tools", think=None)
    assert parse_reply(no_think, "<think>a</think>b").text == "<think>a</think>b"


def test_in_reasoning_start():
    fmt = ReplyFormat.named("json_tools")
    got = parse_reply(fmt, "Let me think.</think>Answer.", in_reasoning=True)
    assert (got.reasoning, got.text) == ("Let me think.", "Answer.")
    got = parse_reply(fmt, "Never closed.", in_reasoning=True)
    assert (got.reasoning, got.text) == ("Never closed.", "")


def test_call_inside_reasoning_is_read_as_in_mlx_lm():
    out = '<think>I will call it.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>Done.'
    got = parse_reply(ReplyFormat.named("json_tools"), out)
    assert got.reasoning == "I will call it."
    assert named_calls(got.calls) == [("get_time", {})]
    assert got.text == "Done."


def test_unterminated_call_is_tried_at_finish():
    fmt = ReplyFormat.named("json_tools")
    got = parse_reply(fmt, '<tool_call>\n{"name": "get_time", "arguments": {}}')
    assert named_calls(got.calls) == [("get_time", {})] and got.failures == []
    cut = '<tool_call>\n{"name": "get_time", "argu'
    got = parse_reply(fmt, cut)
    assert got.calls == [] and got.text == cut and got.failures[0].raw == cut


@pytest.fixture
def fake_parser(monkeypatch):
    """A parser module (dotted path) whose result the test sets, recording its inputs."""
    module = types.ModuleType("fakes_for_test.tool_parser")
    module.tool_call_start, module.tool_call_end = "<call>", "</call>"
    module.seen = []
    module.result = None

    def parse_tool_call(text, tools=None):
        module.seen.append((text, tools))
        if isinstance(module.result, Exception):
            raise module.result
        return module.result

    module.parse_tool_call = parse_tool_call
    monkeypatch.setitem(sys.modules, "fakes_for_test.tool_parser", module)
    return module


def test_parse_tools_false_never_calls_the_parser(fake_parser):
    fmt = ReplyFormat.named("fakes_for_test.tool_parser")
    out = "Use <call>get_time</call> like this."
    got = parse_reply(fmt, out, parse_tools=False)
    assert (got.text, got.calls, got.failures) == (out, [], [])
    assert fake_parser.seen == []
    fake_parser.result = {"name": "get_time", "arguments": {}}
    got = parse_reply(fmt, out, tools=TOOLS)
    assert fake_parser.seen == [("get_time", TOOLS)]  # markers stripped, tools passed
    assert got.text == "Use like this."  # the space after a call is dropped


@pytest.mark.parametrize(
    "result,arguments",
    [
        ({"name": "f", "arguments": {"a": 1}}, {"a": 1}),
        ({"name": "f", "arguments": '{"a": 1}'}, {"a": 1}),
        ({"name": "f", "parameters": {"a": "é"}}, {"a": "é"}),
        ({"name": "f"}, {}),
        ([{"name": "f", "arguments": {}}], {}),
    ],
)
def test_parser_result_shapes_are_normalised(fake_parser, result, arguments):
    fake_parser.result = result
    (call,) = parse_reply(ReplyFormat.named("fakes_for_test.tool_parser"), "<call>x</call>").calls
    assert (call.name, json.loads(call.arguments)) == ("f", arguments)


@pytest.mark.parametrize(
    "result",
    [
        AttributeError("'NoneType' object has no attribute 'group'"),
        KeyError("name"),
        [],
        "get_time",
        {"arguments": {}},
        {"name": "", "arguments": {}},
        {"name": "f", "arguments": "not json"},
        {"name": "f", "arguments": [1, 2]},
        [{"name": "f", "arguments": {}}, None],
    ],
)
def test_unreadable_parser_results_are_failures(fake_parser, result):
    fake_parser.result = result
    got = parse_reply(ReplyFormat.named("fakes_for_test.tool_parser"), "a<call>x</call>b")
    assert got.calls == [] and got.text == "a<call>x</call>b"
    assert len(got.failures) == 1 and got.failures[0].raw == "<call>x</call>"


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool parser"):
        ReplyFormat.named("no_such_family")


def _char_tokenizer(extra_specials=()):
    from tierchat.core.models.tiny import char_tokenizer_json
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(char_tokenizer_json()))
    if extra_specials:
        tok.add_special_tokens({"additional_special_tokens": list(extra_specials)})
    return tok


def test_reply_format_of_a_tokenizer_wrapper():
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.tool_parsers import qwen3_coder

    tok = _char_tokenizer(["<think>", "</think>"])
    wrapper = TokenizerWrapper(
        tok,
        tool_parser=qwen3_coder.parse_tool_call,
        tool_call_start=qwen3_coder.tool_call_start,
        tool_call_end=qwen3_coder.tool_call_end,
    )
    assert ReplyFormat.of(wrapper) == ReplyFormat(
        "qwen3_coder", "<tool_call>", "</tool_call>", "<think>", "</think>"
    )
    assert ReplyFormat.of(TokenizerWrapper(_char_tokenizer())) == ReplyFormat(
        None, None, None, None, None
    )


def test_reply_format_of_a_bare_tokenizer_is_inferred_as_mlx_lm_does():
    tok = _char_tokenizer(["<think>", "</think>"])
    tok.chat_template = (
        "{% for tool_call in message.tool_calls %}<tool_call>{{ tool_call.name }}"
        "</tool_call>{% endfor %}"
    )
    assert ReplyFormat.of(tok) == ReplyFormat.named("json_tools")


XTML = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
XTML_THINK = ("<|open|>think<|sep|>", "<|close|>think<|sep|>")


def test_structural_markers_leave_the_visible_text():
    tok = _char_tokenizer(XTML)  # a Kimi K3 (XTML) vocabulary, no chat template
    fmt = ReplyFormat.of(tok)
    assert fmt.tool_parser == "kimi_k3" and (fmt.think_start, fmt.think_end) == XTML_THINK
    assert "<|open|>response<|sep|>" in fmt.structural_markers
    out = (
        "<|open|>think<|sep|>Easy.<|close|>think<|sep|>\n<|open|>response<|sep|>It is sunny."
        "<|close|>response<|sep|>"
    )
    parser, parts = stream(fmt, out)
    assert (parser.reasoning, parser.text) == ("Easy.", "It is sunny.")
    assert joined(parts, TextDelta) == "It is sunny."


# ---------------------------------------------------------------- bare calls

BARE_TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {}}}]


@pytest.mark.parametrize(
    "reply",
    [
        '{"name": "read", "arguments": {"filePath": "notes.txt"}}',
        '\n```json\n{"name": "read", "arguments": {"filePath": "notes.txt"}}\n```\n',
        '[{"name": "read", "arguments": {"filePath": "notes.txt"}}]',
    ],
)
def test_a_bare_call_naming_a_tool_is_a_call(reply):
    fmt = ReplyFormat.named("json_tools")
    for pieces in ([reply], list(reply)):
        parser = ReplyParser(fmt, tools=BARE_TOOLS)
        parts = [p for piece in pieces for p in parser.feed(piece)] + parser.finish()
        assert not [p for p in parts if isinstance(p, TextDelta)]
        (call,) = parser.calls
        assert call.name == "read" and json.loads(call.arguments) == {"filePath": "notes.txt"}


@pytest.mark.parametrize(
    "reply",
    [
        '{"name": "write", "arguments": {}}',  # not a tool of the request
        '{"name": "read", "arguments": {}} and then some',  # more than the call
        '{"name": "read", "arguments": {}, "why": 1}',  # not a call's shape
        '```python\n{"name": "read", "arguments": {}}\n```',  # another language's fence
        '{"a": 1}',
    ],
)
def test_other_json_stays_text(reply):
    parsed = parse_reply(ReplyFormat.named("json_tools"), reply, tools=BARE_TOOLS)
    assert parsed.text == reply and not parsed.calls


def test_bare_calls_need_tools_and_parsing():
    reply = '{"name": "read", "arguments": {}}'
    fmt = ReplyFormat.named("json_tools")
    assert parse_reply(fmt, reply).text == reply  # no tools in the request
    assert parse_reply(fmt, reply, tools=BARE_TOOLS, parse_tools=False).text == reply
    # text shown first: the reply is not a bare call
    parsed = parse_reply(fmt, "Sure. " + reply, tools=BARE_TOOLS)
    assert parsed.text == "Sure. " + reply and not parsed.calls


def _stream(held, pieces) -> str:
    return "".join(held.feed(p) for p in pieces) + held.finish()


def test_held_calls_show_text_and_hold_a_call_back():
    fmt = ReplyFormat.named("json_tools")
    pieces = [
        "Let me look. <tool",
        '_call>{"name": "get_time", ',
        '"arguments": {}}</tool_call>',
        " Done.",
    ]
    assert (
        _stream(HeldCalls(fmt, TOOLS), pieces) == "Let me look. Done."
    )  # the space after a call goes with it


@pytest.mark.parametrize(
    "cut, rest, shown_at_cut, then",
    [
        # cut after a held "<" that was no marker: the "<" was shown at the cut's end
        ("Hello <", "b> bold", "Hello <", "b> bold"),
        # cut inside a call: its raw text was shown at the cut's end; the continuation
        # completes the call (held back) and the text after it is given whole
        (
            'Hi <tool_call>{"name": "get_time"',
            ', "arguments": {}}</tool_call> and then some text',
            'Hi <tool_call>{"name": "get_time"',
            "and then some text",
        ),
        # cut with nothing held
        ("Plain", " text.", "Plain", " text."),
    ],
)
def test_held_calls_of_a_continue_give_nothing_twice_and_lose_nothing(
    cut, rest, shown_at_cut, then
):
    fmt = ReplyFormat.named("json_tools")
    assert _stream(HeldCalls(fmt, TOOLS), [cut]) == shown_at_cut  # the cut reply's stream
    assert _stream(HeldCalls(fmt, TOOLS, already=cut), [rest]) == then
