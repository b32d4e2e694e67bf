"""Tool rounds, the pure part (docs/DESIGN.md §12.1): a reply split into its text and
calls, the calls resolved against the conversation's tools, and what comes next.

A reply is parsed with the same :class:`~.tool_calls.ReplyParser` serve
uses (mlx-lm's parser of the model's family, bare ``{"name", "arguments"}`` calls of small
models included). Every call the model made gets a result, so the conversation always goes
on:

- a call of a tool the conversation has is run (after approval);
- a call of a function that is no tool of the conversation gets an error result naming
  the tools there are;
- a call the parser could not read (arguments that are not valid JSON) is kept as a call
  with its raw text as ``arguments`` (the name read from it when it can be) and gets an
  error result saying why; its markup leaves the visible text;
- a reply cut at ``max_tokens`` inside a call is no call yet: its text stays visible, and
  a continue reads the whole grown reply again.

A reply whose calls were bare (JSON without the family's markers, or in a ```json fence)
keeps its text as written (``as_written``): the template would render the calls back with
the markers, so the next round's prompt gives the reply as the model wrote it, and its
generated ids splice (docs/DESIGN.md §4).

A round is one assistant step with calls; the steps after the last user message are
counted, and a step past ``max_rounds`` has its calls answered "not run" instead of run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..tools.mcp_host import ToolInfo
from .tool_calls import ReplyFormat, ReplyParser, ToolCall

DEFAULT_MAX_ROUNDS = 8
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"\\]{1,64})"')


@dataclass(frozen=True)
class SplitReply:
    """A generated reply: ``content`` (the visible text, calls removed), ``reasoning``
    (think-block text, "" for none), ``tool_calls`` in OpenAI chat form
    (``{"id", "type": "function", "function": {"name", "arguments"}}``, arguments JSON
    text, or the raw text of a call that could not be read) and ``unreadable`` (the ids
    of those, with the parser's reason); ``bare``: the calls were read without the
    family's markers (``ReplyParser.bare``, core/chat/tool_calls.py)."""

    content: str
    reasoning: str
    tool_calls: tuple[dict[str, Any], ...]
    unreadable: dict[str, str]
    bare: bool = False


def openai_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def split_reply(
    fmt: ReplyFormat,
    text: str,
    tools: Sequence[dict[str, Any]],
    *,
    in_reasoning: bool = False,
    cut: bool = False,
) -> SplitReply:
    """``text`` (a whole reply) split by the model family's parser, ``tools`` (OpenAI
    function tools) given to it; ``cut``: the reply ended at ``max_tokens``, so a call
    without its end marker is text still (a continue completes it)."""
    parser = ReplyParser(fmt, tools=list(tools) or None, in_reasoning=in_reasoning)
    parser.feed(text)
    parser.finish()
    content = parser.text
    calls = [openai_call(c) for c in parser.calls]
    unreadable: dict[str, str] = {}
    for failure in parser.failures:
        if cut and not (fmt.tool_call_end and failure.raw.endswith(fmt.tool_call_end)):
            continue  # cut inside the call: its text stays as it was emitted
        content = content.replace(failure.raw, "", 1)
        body = failure.raw
        for marker in (fmt.tool_call_start, fmt.tool_call_end):
            if marker:
                body = body.replace(marker, "", 1)
        name = _NAME_RE.search(body)
        call = ToolCall(
            ToolCall.new_id(), name.group(1) if name else "unreadable_call", body.strip()
        )
        calls.append(openai_call(call))
        unreadable[call.id] = failure.error
    content = content.strip() if calls else content
    return SplitReply(content, parser.reasoning, tuple(calls), unreadable, parser.bare)


def reply_meta(
    fmt: ReplyFormat, text: str, tools: Sequence[dict[str, Any]], *, cut: bool = False
) -> dict[str, Any]:
    """What a reply of a prompt with ``tools`` stores besides its text: {} when it made no
    call; else ``tool_calls`` (OpenAI form), ``tool_call_errors`` (id -> why unreadable)
    and ``reasoning_content`` when there are any, ``as_written`` (``text``) when the calls
    were bare (module docstring), and ``content``, the visible text to store instead of
    ``text``. ``cut``: as :func:`split_reply` takes it."""
    split = split_reply(fmt, text, tools, cut=cut)
    if not split.tool_calls:
        return {}
    out: dict[str, Any] = {"content": split.content, "tool_calls": list(split.tool_calls)}
    if split.unreadable:
        out["tool_call_errors"] = dict(split.unreadable)
    if split.reasoning:
        out["reasoning_content"] = split.reasoning
    if split.bare:
        out["as_written"] = text
    return out


@dataclass(frozen=True)
class PlannedCall:
    """One call of a reply, resolved: ``tool`` is the tool it runs (None when it cannot
    run), ``error`` why not ("" when it can), ``arguments`` the decoded object."""

    id: str
    function: str
    arguments_text: str
    arguments: dict[str, Any]
    tool: ToolInfo | None
    error: str = ""

    @property
    def display(self) -> str:
        """``server.tool``, or the function name the model used."""
        return self.tool.display if self.tool is not None else self.function


def plan_calls(
    tool_calls: Sequence[dict[str, Any]],
    tools: Sequence[ToolInfo],
    unreadable: dict[str, str] | None = None,
) -> list[PlannedCall]:
    """``tool_calls`` (OpenAI form) resolved against ``tools`` by function name."""
    by_name = {t.function: t for t in tools}
    out = []
    for call in tool_calls:
        fn = call.get("function") or {}
        cid, name, args_text = str(call.get("id", "")), str(fn.get("name", "")), fn.get("arguments")
        args_text = args_text if isinstance(args_text, str) else json.dumps(args_text or {})
        if unreadable and cid in unreadable:
            why = f"the call could not be read ({unreadable[cid]}): its arguments must be a JSON object"
            out.append(PlannedCall(cid, name, args_text, {}, None, why))
            continue
        try:
            args = json.loads(args_text) if args_text.strip() else {}
        except ValueError as e:
            args = None
            why = f"the arguments are not valid JSON ({e})"
        else:
            why = "" if isinstance(args, dict) else "the arguments must be a JSON object"
        tool = by_name.get(name)
        if tool is None:
            names = ", ".join(sorted(by_name)) or "none"
            why = f"there is no tool named {name!r} (the tools are: {names})"
        out.append(
            PlannedCall(
                cid,
                name,
                args_text,
                args if isinstance(args, dict) else {},
                tool if not why else None,
                why,
            )
        )
    return out


Step = Literal["done", "run", "limit"]


def next_step(n_calls: int, rounds: int, max_rounds: int) -> Step:
    """What follows an assistant step with ``n_calls`` calls that is round ``rounds``
    (1-based) since the last user message: "done" (no calls: the answer), "run" (run the
    calls, then generate the next step), "limit" (past ``max_rounds``: answer the calls
    "not run" and stop)."""
    if n_calls == 0:
        return "done"
    return "run" if rounds <= max_rounds else "limit"


def limit_text(max_rounds: int) -> str:
    return (
        f"not run: this answer reached the limit of {max_rounds} tool rounds "
        "(the tool_rounds setting); answer with what you have"
    )


def denied_text(reason: str) -> str:
    reason = reason.strip()
    return "the user denied this call" + (f": {reason}" if reason else "")
