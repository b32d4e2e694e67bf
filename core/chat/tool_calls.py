"""Reply parsing: a model's generated text split into reasoning, visible text and tool calls.

A :class:`ReplyParser` is fed the text deltas of one reply as the engine streams them and
returns :data:`ReplyPart` s as soon as they are known:

- text between the think markers (``<think>`` … ``</think>``, or the family's own) is
  :class:`ReasoningDelta`; whitespace right after the end marker (and after a tool call)
  is dropped from the visible text, as common OpenAI-compatible servers do;
- text between the tool-call markers is one call, read by the family's mlx-lm parser when
  its end marker arrives (:class:`ToolCallDelta`); families without an end marker
  (mistral's ``[TOOL_CALLS]``) are read at :meth:`ReplyParser.finish`;
- everything else is :class:`TextDelta`, emitted at once except for a tail that could be
  the start of a marker split across deltas (``"<tool_"`` + ``"call>"``).

Sources: the markers and ``parse_tool_call(text, tools)`` functions are mlx-lm's
(``mlx_lm/tool_parsers/<family>.py``); which family a tokenizer uses comes from mlx-lm's
``TokenizerWrapper`` (``tool_parser``, ``tool_call_start``/``_end``, ``think_start``/``_end``)
or, for a bare Hugging Face tokenizer, ``mlx_lm.tokenizer_utils._infer_tool_parser`` and
``_infer_thinking``. The state machine follows mlx-lm's ``make_text_state_machine``
(``generate.py``): a call may also start inside reasoning, and the text after a call is
visible text. As in mlx-lm's ``server.py``, the parser gets the call's text without its
markers.

Shapes: a parser may return one ``{"name", "arguments"}`` dict or a list of them (parallel
calls in one block: kimi_k2, mistral, pythonic, gemma4, minimax_m2); ``arguments`` may be a
dict or JSON text (``"parameters"`` is accepted for ``"arguments"``). Each becomes a
:class:`ToolCall` whose ``arguments`` is JSON object text and whose ``id`` is fresh (a
model's own id, such as kimi's ``functions.f:0``, is not kept).

A reply that is nothing but a bare call, ``{"name": <a tool of the request>, "arguments":
{...}}`` (or a list of them, or one in a ```json fence) without the family's markers, is
read as that call: small models (the demo Qwen2.5-Coder-0.5B) often drop the markers. Its
text is held back from its first ``{``, ``[`` or fence to the end (and whitespace before
it); anything else is text.

Errors: model output never raises. A call the parser cannot read (it raises anything, or
returns no call, a call without a name, or arguments that are not a JSON object) is
emitted as visible text, markers included, plus a :class:`ToolCallFailed` with the reason
for the caller to log. With ``parse_tools=False`` the markers are plain text and the
parser is never called. This module imports no MLX; a family's parser module is imported
(with mlx_lm) the first time a :class:`ReplyFormat` names it.
"""

from __future__ import annotations

import importlib
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Literal, NamedTuple

_PARSERS_PACKAGE = "mlx_lm.tool_parsers"


@dataclass(frozen=True)
class ToolCall:
    """One function call: ``arguments`` is JSON object text (OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str

    @staticmethod
    def new_id() -> str:
        """A fresh id: ``"call_"`` + 24 hex characters."""
        return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One complete call, emitted when its end marker arrives (or at finish)."""

    index: int  # 0, 1, ... within the reply
    call: ToolCall


@dataclass(frozen=True)
class ToolCallFailed:
    """A call the parser could not read; ``raw`` (markers included) was also emitted as text."""

    raw: str
    error: str


ReplyPart = TextDelta | ReasoningDelta | ToolCallDelta | ToolCallFailed


def _parser_module(name: str) -> ModuleType:
    """The parser module ``name``: an mlx-lm family ("json_tools") or a dotted module path."""
    path = name if "." in name else f"{_PARSERS_PACKAGE}.{name}"
    try:
        return importlib.import_module(path)
    except ImportError as e:
        raise ValueError(f"unknown tool parser {name!r} (no module {path})") from e


def _module_name(parse: Callable) -> str:
    module = parse.__module__
    prefix = _PARSERS_PACKAGE + "."
    return module[len(prefix) :] if module.startswith(prefix) else module


@dataclass(frozen=True)
class ReplyFormat:
    """What a tokenizer's replies look like: tool-call markers + parse function, think markers.

    ``tool_parser`` names the mlx-lm module (``mlx_lm/tool_parsers/<name>.py``) whose
    ``parse_tool_call`` reads a call, or a dotted module path with the same function. An
    empty or None ``tool_call_end`` means calls run to the end of the reply (mistral).
    Tool calls are recognised only when both ``tool_parser`` and ``tool_call_start`` are set.
    ``structural_markers`` are removed from visible text (mlx-lm's ``structural_markers``
    of XTML vocabularies such as Kimi K3's ``<|open|>response<|sep|>``).
    """

    tool_parser: str | None
    tool_call_start: str | None
    tool_call_end: str | None
    think_start: str | None
    think_end: str | None
    structural_markers: tuple[str, ...] = ()

    @property
    def has_tool_calling(self) -> bool:
        return bool(self.tool_parser and self.tool_call_start)

    @property
    def has_thinking(self) -> bool:
        return bool(self.think_start and self.think_end)

    def parse_function(self) -> Callable[[str, Any], Any]:
        """The family's ``parse_tool_call(text, tools)``.

        Raises:
            ValueError: no tool parser, or its module does not import.
        """
        if not self.tool_parser:
            raise ValueError("this reply format has no tool parser")
        return _parser_module(self.tool_parser).parse_tool_call

    @classmethod
    def named(
        cls, parser: str | None, think: tuple[str, str] | None = ("<think>", "</think>")
    ) -> ReplyFormat:
        """The format of mlx-lm's ``parser`` family (its module's markers) and ``think``.

        Raises:
            ValueError: ``parser`` is not an importable parser module.
        """
        start, end = think if think else (None, None)
        if parser is None:
            return cls(None, None, None, start, end)
        module = _parser_module(parser)
        return cls(parser, module.tool_call_start, module.tool_call_end or None, start, end)

    @classmethod
    def of(cls, tokenizer: Any) -> ReplyFormat:
        """The format of an mlx-lm ``TokenizerWrapper``, or of a bare Hugging Face tokenizer.

        A wrapper says it all (``tool_parser`` is the parse function; its module is named
        here). A bare tokenizer is inferred as ``mlx_lm.tokenizer_utils.load`` does: the
        ``tool_parser_type`` of its config, else ``_infer_tool_parser``, and
        ``_infer_thinking`` for the think markers. Anything else (a tokenizer with no
        vocabulary to read) has plain-text replies.
        """
        if hasattr(type(tokenizer), "tool_call_start"):  # TokenizerWrapper (a property)
            parse = tokenizer.tool_parser
            start = tokenizer.tool_call_start if parse is not None else None
            return cls(
                _module_name(parse) if start else None,
                start or None,
                (tokenizer.tool_call_end or None) if start else None,
                tokenizer.think_start,
                tokenizer.think_end,
                tuple(tokenizer.structural_markers),
            )
        if not hasattr(tokenizer, "get_vocab"):  # neither: plain text, no markers
            return cls(None, None, None, None, None)
        from mlx_lm.tokenizer_utils import (
            _infer_structural_markers,
            _infer_thinking,
            _infer_tool_parser,
        )

        think_start, think_end, _, _ = _infer_thinking(tokenizer)
        config = getattr(tokenizer, "init_kwargs", None) or {}
        parser = config.get("tool_parser_type") or _infer_tool_parser(tokenizer)
        think = (think_start, think_end) if think_start and think_end else None
        markers = tuple(_infer_structural_markers(tokenizer))
        return replace(cls.named(parser, think), structural_markers=markers)


_State = Literal["text", "reasoning", "call"]


def _read_calls(parsed: Any) -> list[ToolCall]:
    """``parse_tool_call``'s result as calls; raises ValueError on a shape that is none."""
    items = parsed if isinstance(parsed, list) else [parsed]
    if not items:
        raise ValueError("the parser returned no call")
    calls = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError(f"a call is {type(item).__name__}, not an object")
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a call without a function name: {item!r}")
        arguments = item.get("arguments", item.get("parameters"))
        if arguments is None:
            arguments = {}
        elif isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
        if not isinstance(arguments, dict):
            raise ValueError(f"arguments of {name!r} are {type(arguments).__name__}, not an object")
        calls.append(
            ToolCall(ToolCall.new_id(), name.strip(), json.dumps(arguments, ensure_ascii=False))
        )
    return calls


def _held_back(text: str, markers: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ReplyParser:
    """Streaming split of one reply; see the module docstring.

    Args:
        fmt: the model's reply format.
        tools: the request's OpenAI function-tool list, passed to the family's parser
            (some read parameter types from it).
        parse_tools: False (``tool_choice: "none"``, or no tools in the request) keeps
            tool-call markup as text and never calls the parser.
        in_reasoning: the prompt ended inside a think block (the template opened it), so
            the reply starts as reasoning.

    Accumulated: ``text``, ``reasoning``, ``calls``, ``failures``; ``bare``: the calls
    were read from a bare form (no markers of the family: JSON, or JSON in a fence),
    which the chat template does not render back as the model wrote it.

    Raises:
        ValueError: (constructor) the format's parser module does not import, when
            ``parse_tools`` is on; model output never raises.
    """

    def __init__(
        self,
        fmt: ReplyFormat,
        *,
        tools: list[dict] | None = None,
        parse_tools: bool = True,
        in_reasoning: bool = False,
    ) -> None:
        self.fmt = fmt
        self.tools = tools
        self._parse = fmt.parse_function() if parse_tools and fmt.has_tool_calling else None
        self._state: _State = "reasoning" if in_reasoning and fmt.has_thinking else "text"
        self._edges = self._transitions()
        self._pending = ""  # a possible marker prefix, held back
        self._call_body = ""
        self._call_start = ""
        self._drop_space = False  # drop leading whitespace of the next visible text
        self._finished = False
        self.text = ""
        self.reasoning = ""
        self.calls: list[ToolCall] = []
        self.failures: list[ToolCallFailed] = []
        # a bare call: a reply that is only ``{"name": <a tool>, "arguments": {...}}`` (small
        # models often drop the markers) is held back from its first ``{`` or code fence and
        # read at finish (:func:`_bare_calls`)
        names = [t.get("function", t).get("name") for t in tools or () if isinstance(t, dict)]
        self._tool_names = {n for n in names if isinstance(n, str)}
        self._bare: str | None = None
        self.bare = False
        self._bare_released = False  # held once and shown: never held again
        self._lead = ""  # whitespace before a possible bare call

    def _transitions(self) -> dict[_State, list[tuple[str, _State]]]:
        fmt = self.fmt
        edges: dict[_State, list[tuple[str, _State]]] = {"text": [], "reasoning": [], "call": []}
        if fmt.has_thinking:
            edges["text"].append((fmt.think_start, "reasoning"))
            edges["reasoning"].append((fmt.think_end, "text"))
        if self._parse is not None:
            edges["text"].append((fmt.tool_call_start, "call"))
            edges["reasoning"].append((fmt.tool_call_start, "call"))
            if fmt.tool_call_end:
                edges["call"].append((fmt.tool_call_end, "text"))
        edges["text"] += [(marker, "text") for marker in fmt.structural_markers if marker]
        return edges

    def feed(self, text: str) -> list[ReplyPart]:
        """Parts known after ``text`` (the next delta; split anywhere, even in a marker).

        Raises:
            RuntimeError: after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("feed() after finish()")
        out: list[ReplyPart] = []
        buf = self._pending + text
        while True:
            hit = self._first_marker(buf)
            if hit is None:
                break
            at, marker, state = hit
            self._take(buf[:at], out)
            buf = buf[at + len(marker) :]
            self._enter(marker, state, out)
        keep = _held_back(buf, [m for m, _ in self._edges[self._state]])
        self._take(buf[: len(buf) - keep], out)
        self._pending = buf[len(buf) - keep :]
        return out

    def finish(self) -> list[ReplyPart]:
        """Flush held-back text; read an unterminated call (else text + ToolCallFailed)."""
        if self._finished:
            return []
        out: list[ReplyPart] = []
        self._take(self._pending, out)
        self._pending = ""
        if self._state == "call":
            self._close_call("", out)
        if self._lead:  # a reply of whitespace only
            self._bare_released = True
            self._emit_text(self._lead, out)
        if self._bare is not None:
            held, self._bare = self._bare, None
            calls = _bare_calls(held, self._tool_names)
            if calls:
                self.bare = True
                for call in calls:
                    out.append(ToolCallDelta(len(self.calls), call))
                    self.calls.append(call)
            else:
                self._bare_released = True
                self._emit_text(held, out)
        self._finished = True
        return out

    def _first_marker(self, buf: str) -> tuple[int, str, _State] | None:
        best = None
        for marker, state in self._edges[self._state]:
            at = buf.find(marker)
            if at >= 0 and (best is None or (at, -len(marker)) < (best[0], -len(best[1]))):
                best = (at, marker, state)
        return best

    def _take(self, text: str, out: list[ReplyPart]) -> None:
        """``text`` in the current state."""
        if self._state == "call":
            self._call_body += text
        elif self._state == "reasoning":
            if text:
                self.reasoning += text
                out.append(ReasoningDelta(text))
        else:
            self._emit_text(text, out)

    def _emit_text(self, text: str, out: list[ReplyPart]) -> None:
        if self._drop_space:
            text = text.lstrip()
            self._drop_space = not text
        if not text:
            return
        if self._bare is not None:
            self._bare += text
            return
        if (
            self._parse is not None
            and not self._bare_released
            and self._tool_names
            and not self.text
            and not self.calls
        ):
            text = self._lead + text
            self._lead = ""
            if text.isspace():  # leading whitespace: shown with what follows it
                self._lead = text
                return
            if text.lstrip()[:1] in ("{", "[", "`"):
                self._bare = text
                return
        self.text += text
        out.append(TextDelta(text))

    def _flush_bare(self, out: list[ReplyPart]) -> None:
        """A marker came: the held text was not a bare call; show it."""
        if self._bare is not None:
            held, self._bare = self._bare, None
            self._bare_released = True
            self._emit_text(held, out)

    def _enter(self, marker: str, state: _State, out: list[ReplyPart]) -> None:
        self._flush_bare(out)
        if state == "call":
            self._call_start, self._call_body = marker, ""
            self._state = "call"
        elif self._state == "call":
            self._close_call(marker, out)
        elif self._state == "reasoning":  # the think end marker
            self._state = state
            self._drop_space = True
        else:
            self._state = state  # reasoning, or text again after a structural marker

    def _close_call(self, end_marker: str, out: list[ReplyPart]) -> None:
        """Read the call just ended (``end_marker`` "" when the reply ended instead)."""
        self._state = "text"
        body, self._call_body = self._call_body, ""
        try:
            calls = _read_calls(self._parse(body, self.tools))
        except Exception as e:  # noqa: BLE001 -- a parser may raise anything on bad output
            raw = self._call_start + body + end_marker
            failure = ToolCallFailed(raw, f"{type(e).__name__}: {e}")
            self._drop_space = False
            self._emit_text(raw, out)
            self.failures.append(failure)
            out.append(failure)
            return
        for call in calls:
            out.append(ToolCallDelta(len(self.calls), call))
            self.calls.append(call)
        self._drop_space = True


def _bare_calls(text: str, names: set[str]) -> list[ToolCall]:
    """The calls of a reply that is only a bare call, without the family's markers: one
    JSON object ``{"name", "arguments"}`` (or a list of them), optionally in a code fence,
    naming a tool of the request. [] when it is anything else (then it is text)."""
    body = text.strip()
    if body.startswith("```"):
        first, _, rest = body.partition("\n")
        if not rest.rstrip().endswith("```") or first.strip("`").strip() not in ("", "json"):
            return []
        body = rest.rstrip()[:-3].strip()
    try:
        parsed = json.loads(body)
    except ValueError:
        return []
    items = parsed if isinstance(parsed, list) else [parsed]
    if not items or not all(isinstance(i, dict) and i.get("name") in names for i in items):
        return []
    if not all(set(i) <= {"name", "arguments", "parameters"} for i in items):
        return []
    try:
        return _read_calls(items)
    except ValueError:
        return []


class ParsedReply(NamedTuple):
    text: str
    reasoning: str
    calls: list[ToolCall]
    failures: list[ToolCallFailed]


def parse_reply(fmt: ReplyFormat, text: str, **kw: Any) -> ParsedReply:
    """A whole reply split at once (``kw`` as for :class:`ReplyParser`)."""
    parser = ReplyParser(fmt, **kw)
    parser.feed(text)
    parser.finish()
    return ParsedReply(parser.text, parser.reasoning, list(parser.calls), list(parser.failures))


class HeldCalls:
    """A streaming reply's text as a reader sees it while it streams: its tool calls held
    back (a round shows each as a call of its own once the reply is stored), reasoning
    shown as it comes (the format's think markers off). Used by ``tierchat chat`` and
    the TUI's reply stream alike.

    :meth:`feed` takes each streamed delta and returns the text to add; :meth:`finish`
    returns what is still held at the end (a bare ``{…}`` that was no call). For a
    continue, ``already`` is the cut reply's text: the parser reads it first. What the
    cut reply's stream released only at its end (held text, a call cut in two shown as
    its raw text) was shown already: released again as the same text, it is not given
    twice; once the continuation's text departs from it (the cut call completed, say),
    everything new is given.
    """

    def __init__(self, fmt: ReplyFormat, tools: list[dict] | None, already: str = "") -> None:
        fmt = replace(fmt, think_start=None, think_end=None)
        self._parser = ReplyParser(fmt, tools=tools)
        self._ahead = ""  # text shown at the cut reply's end that this parser still holds
        if already:
            self._parser.feed(already)
            cut = ReplyParser(fmt, tools=tools)  # the cut reply's stream, to its end
            cut.feed(already)
            cut.finish()
            self._ahead = cut.text[len(self._parser.text) :]

    @classmethod
    def for_turn(cls, engine: Any, turn: Any) -> HeldCalls | None:
        """For the reply of ``turn`` (a session's turn handle: its ``tools``, and the
        ``continued`` reply a continue extends) by ``engine``'s model (its ``tokenizer``,
        read only when there are tools); None when the turn has no tools (nothing to
        hold back).

        Raises:
            ValueError: the family's parser module does not import.
        """
        tools = getattr(turn, "tools", None)
        if not tools:
            return None
        from .token_text import decode_ids

        tokenizer = engine.tokenizer
        continued = getattr(turn, "continued", None)
        ids = (continued.token_ids or ()) if continued is not None else ()
        already = decode_ids(tokenizer, ids, skip_special=True) if ids else ""
        return cls(ReplyFormat.of(tokenizer), list(tools), already)

    def feed(self, delta: str) -> str:
        return self._visible(self._parser.feed(delta))

    def finish(self) -> str:
        return self._visible(self._parser.finish())

    def _visible(self, parts: list[ReplyPart]) -> str:
        text = "".join(p.text for p in parts if isinstance(p, TextDelta))
        if not self._ahead or not text:
            return text
        same = len(os.path.commonprefix([text, self._ahead]))
        # all of it shown already: hold the rest; else (past it, or departed) give the new
        self._ahead = self._ahead[same:] if same == len(text) else ""
        return text[same:]
