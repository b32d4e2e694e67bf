"""One reply as every API reads it: the engine's events for a prepared request (cut
before the client's stop strings by the engine, which the request carries them to), split by the model's reply format into reasoning, text and
tool calls (:class:`~tierchat.core.chat.tool_calls.ReplyParser`, mlx-lm's per-family
parsers), with keep-alives while nothing comes and one :class:`ReplyEnd` at the end
(docs/DESIGN.md §15). Each adapter writes these parts in its own wire format.

A call the parser cannot read stays text (its ``ToolCallFailed`` is logged as a warning,
never a 500); ``tool_choice: none`` never parses; with ``parallel_tool_calls`` false only
a reply's first call is returned (the later ones are dropped, and logged).
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from starlette.requests import Request

from ..api import Failed, Finished, TokenBatch, TurnMetrics
from ..chat.tool_calls import ReplyParser, ReplyPart, ToolCall, ToolCallDelta, ToolCallFailed
from ..text import log_safe
from .generation import Generation, KeepAlive
from .prompts import APIError, returned_tokens
from .replies import failure
from .request import Prepared
from .state import ServeState

FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True)
class ReplyEnd:
    """How a reply ended. ``finish_reason``: ``tool_calls`` when it holds a parsed call,
    ``length`` at ``max_tokens``, else ``stop`` (an end token or a stop string:
    ``stop_sequence`` names the string). ``completion_tokens``: the tokens returned (fewer
    than generated when a stop string cut the reply). ``text`` is the visible text,
    ``reasoning`` the think block's, ``calls`` the parsed calls."""

    finish_reason: FinishReason
    stop_sequence: str | None
    metrics: TurnMetrics
    completion_tokens: int
    text: str
    reasoning: str
    calls: tuple[ToolCall, ...]


ReplyEvent = ReplyPart | KeepAlive | ReplyEnd | APIError


async def read_reply(
    state: ServeState,
    gen: Generation,
    prep: Prepared,
    http: Request | None = None,
    keepalive: bool = False,
) -> AsyncIterator[ReplyEvent]:
    """The reply's parts as they come, then a :class:`ReplyEnd`, or an :class:`APIError`
    (the engine failed, or the server is stopping). ``http``: for a whole (non-streamed)
    reply, the client whose disconnect cancels it; ``keepalive``: yield
    :class:`KeepAlive` once ``state.keepalive_s`` passed without anything yielded (streams):
    after a wait without an event, and on an event that yields nothing: a prefill's
    progress (a long prefill sends progress now and then, and the client nothing else) or
    a batch of tokens held back (a tool call being written: on a slow machine a call of a
    few hundred tokens takes minutes, and Codex ends a stream after 300 s without an
    event, Claude Code after 300 s without a chunk)."""
    parser = ReplyParser(
        prep.fmt,
        tools=list(prep.tools) or None,
        parse_tools=prep.parse_tools,
        in_reasoning=prep.in_reasoning,
    )
    if prep.forced_call and prep.fmt.tool_call_start:
        parser.feed(prep.fmt.tool_call_start)  # the prompt opened the call: held, not shown
    keep_s = state.keepalive_s if keepalive else None
    last = time.monotonic()
    async for event in gen.events(http, keepalive_s=keep_s):
        if keep_s is not None and not isinstance(event, TokenBatch | Finished):
            if isinstance(event, KeepAlive) or time.monotonic() - last >= keep_s:
                last = time.monotonic()
                yield KeepAlive()
        if isinstance(event, KeepAlive):
            continue
        if isinstance(event, TokenBatch):
            parts = _first_calls(_parts(parser, event.text), prep.max_calls)
            for part in parts:
                yield part
            if parts or keep_s is None:
                last = time.monotonic()
            elif time.monotonic() - last >= keep_s:  # the batch was held back
                last = time.monotonic()
                yield KeepAlive()
        elif isinstance(event, Failed):
            yield failure(event)
        elif isinstance(event, APIError):
            yield event
        elif isinstance(event, Finished):
            for part in _first_calls(_log_failed(parser.finish()), prep.max_calls):
                yield part
            cut = event.stop_sequence is not None
            state.memory.remember(state.engine.tokenizer, event.text, event.token_ids)
            n = returned_tokens(state.engine.tokenizer, event.token_ids, event.text, cut)
            calls = tuple(parser.calls[: prep.max_calls])
            if calls:
                reason: FinishReason = "tool_calls"
            elif event.metrics.finish_reason == "length":
                reason = "length"
            else:
                reason = "stop"
            yield ReplyEnd(
                reason,
                event.stop_sequence,
                event.metrics,
                n,
                parser.text,
                parser.reasoning,
                calls,
            )


def _parts(parser: ReplyParser, text: str) -> list[ReplyPart]:
    return _log_failed(parser.feed(text)) if text else []


def _first_calls(parts: list[ReplyPart], max_calls: int | None) -> list[ReplyPart]:
    """``parts`` without the calls past ``max_calls`` (None: all kept)."""
    if max_calls is None:
        return parts
    kept = [p for p in parts if not (isinstance(p, ToolCallDelta) and p.index >= max_calls)]
    if len(kept) < len(parts):
        print(
            f"parallel_tool_calls is false: {len(parts) - len(kept)} later call(s) dropped",
            file=sys.stderr,
        )
    return kept


def _log_failed(parts: list[ReplyPart]) -> list[ReplyPart]:
    for part in parts:
        if isinstance(part, ToolCallFailed):
            print(
                f"warning: a tool call could not be parsed ({log_safe(part.error[:200])}); "
                "it is returned as text",
                file=sys.stderr,
            )
    return [p for p in parts if not isinstance(p, ToolCallFailed)]
