"""The one internal request behind every API of ``tierchat serve`` (docs/DESIGN.md §15).

Each adapter (OpenAI chat completions, Anthropic Messages, Responses) turns its body into
a :class:`ChatRequest`: messages in one form (OpenAI chat's: ``role``, ``content``,
``tool_calls``, ``tool_call_id``, ``reasoning_content``), the tools (OpenAI function tools),
the tool choice, sampling, stop strings and the thinking switch. :func:`prepare` then
builds its prompt with the chat's :class:`~tierchat.core.chat.prompts.PromptBuilder` (the
template's ``tools=`` and thinking switch; reply ids spliced from the reply memory), checks
ids and length, and makes the engine's
:class:`~tierchat.core.api.GenerateRequest`. The same conversation through any API, in
any of its JSON forms, gives the same messages here, so the same token ids.

A forced tool call (``tool_choice`` ``required`` or a named function) appends the
family's tool-call start marker to the prompt, so the model's first tokens are a call
(a named function also narrows the tools to that one); the reply parser starts inside it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..api import GenerateRequest
from ..chat.prompts import Prompt, template_supports_tools
from ..chat.tool_calls import ReplyFormat
from ..sampling_params import SamplingParams
from .generation import ClientGone, off_loop
from .guard import authorize
from .limits import check_prompt, context_length, model_vocab, parse_body
from .prompts import APIError, ReplyMemory
from .replies import client_gone, internal_error, shutting_down
from .state import ServeState

ToolChoice = Literal["auto", "none", "required"]
T = TypeVar("T")


@dataclass(frozen=True)
class ChatRequest:
    """One chat generation, as every API asks for it.

    ``messages``: dicts with ``role`` (system, user, assistant, tool), ``content`` (str),
    and where they apply ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}]``), ``tool_call_id``, ``reasoning_content``. ``tools``: OpenAI
    function tools ``{"type": "function", "function": {"name", "description",
    "parameters"}}``. ``tool_choice``: ``auto``, ``none`` (calls are never parsed) or
    ``required``; ``forced_tool``: a named function (implies ``required``).
    ``max_tokens_explicit``: the client's own limit must fit beside the prompt (OpenAI:
    400 past the context); ``clamp_max_tokens``: it is cut to what fits (Anthropic's
    clients send 32,000 whatever the model). ``stream``: the reply as server-sent events
    (``include_usage``: with a last usage chunk). ``enable_thinking``: the template's
    thinking switch, None for its default.
    """

    messages: tuple[dict[str, Any], ...]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False  # OpenAI's stream_options
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: ToolChoice = "auto"
    forced_tool: str | None = None
    parallel_tool_calls: bool = True
    enable_thinking: bool | None = None
    max_tokens_explicit: bool = False
    clamp_max_tokens: bool = False
    param: str = "messages"  # the body field errors about the prompt name


@dataclass(frozen=True)
class Prepared:
    """A checked request, ready for the engine: the :class:`GenerateRequest`, its prompt,
    and what the reply parser needs (the model's :class:`ReplyFormat`, whether the reply
    starts inside a think block or a forced tool call, whether calls are parsed)."""

    request: GenerateRequest
    prompt: Prompt
    fmt: ReplyFormat
    tools: tuple[dict[str, Any], ...] = ()
    parse_tools: bool = False
    in_reasoning: bool = False
    forced_call: bool = False
    max_calls: int | None = None  # 1: ``parallel_tool_calls`` false (later calls are dropped)
    reused_replies: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


async def read_body(http: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes. Raises :class:`APIError` 413 beyond it
    (by ``Content-Length`` before reading, or while reading a chunked body), and
    :class:`ClientGone` when the client closes its connection before the body's end."""
    too_big = APIError(
        f"the request body is larger than {limit} bytes", 413, code="request_too_large"
    )
    length = http.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone("while sending its body") from None
    return b"".join(chunks)


async def receive(state: ServeState, http: Request) -> dict[str, Any]:
    """Check the key, read and parse the JSON body. Raises :class:`APIError`."""
    authorize(state, http)
    raw = await read_body(http, state.limits.max_body_bytes)
    body = parse_body(http.headers.get("content-type"), raw)
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def attach_reply_ids(messages: Sequence[dict[str, Any]], memory: ReplyMemory) -> int:
    """Give each assistant message whose text the reply memory knows the ids the model
    generated for it (``token_ids``, spliced by the builder). Returns how many."""
    reused = 0
    for m in messages:
        if m.get("role") == "assistant" and m.get("content") and not m.get("tool_calls"):
            ids = memory.lookup(m["content"])
            if ids is not None:
                m["token_ids"] = ids
                reused += 1
    return reused


def check_tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` in the internal form, checked: each
    ``{"id", "type": "function", "function": {"name": str, "arguments": str}}``; arguments
    given as an object are written as JSON text. Raises :class:`APIError` 400."""
    if not isinstance(calls, list):
        raise APIError("'tool_calls' must be a list", param=param)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise APIError("a tool call needs function.name", param=f"{param}.{i}")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        ident = call.get("id") if isinstance(call.get("id"), str) else f"call_{i}"
        out.append({"id": ident, "type": "function", "function": {"name": name, "arguments": args}})
    return out


def check_tools(tools: Any, param: str = "tools") -> tuple[dict[str, Any], ...]:
    """OpenAI function tools, checked: a list of ``{"type": "function", "function": {"name",
    ...}}`` with distinct names. Raises :class:`APIError` 400."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise APIError("'tools' must be a list", param=param)
    out, names = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(fn, Mapping)
        ):
            raise APIError(
                "each tool must be {'type': 'function', 'function': {...}}", param=f"{param}.{i}"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise APIError("each tool needs a distinct function.name", param=f"{param}.{i}")
        names.add(name)
        out.append({"type": "function", "function": dict(fn)})
    return tuple(out)


def normalize_system(
    messages: Sequence[dict[str, Any]], patterns: Sequence[str]
) -> list[dict[str, Any]]:
    """``messages`` with every line of a system message that a pattern matches removed
    (``re.search`` on the line without its line break; ``^``/``$`` anchor at the line's
    ends), with that line break; when a line was removed, line breaks left at the start
    and end of the message are dropped too. Other messages are returned as given.

    Why: clients put per-version or per-session lines in the system prompt (Claude Code's
    ``x-anthropic-billing-header: cc_version=...; cch=...``). Left in, the first tokens of
    the prompt change with every client release and session, and no cached prefix
    survives them (:attr:`ServeState.system_line_filters`, one rule by default). Applies
    to every API: the same system prompt gives the same ids whichever API sent it.

    Raises ``re.error`` for a bad pattern (checked when the state is made)."""
    compiled = [re.compile(p) for p in patterns]
    if not compiled:
        return list(messages)
    out = []
    for m in messages:
        content = m.get("content")
        if m.get("role") == "system" and isinstance(content, str):
            lines = content.splitlines(keepends=True)
            kept = [ln for ln in lines if not any(c.search(ln.rstrip("\r\n")) for c in compiled)]
            if len(kept) != len(lines):
                m = {**m, "content": "".join(kept).strip("\r\n")}
        out.append(m)
    return out


def _build(state: ServeState, chat: ChatRequest, tools: tuple[dict[str, Any], ...]) -> Prompt:
    builder = state.builder()
    messages = [dict(m) for m in normalize_system(chat.messages, state.system_line_filters)]
    attach_reply_ids(messages, state.memory)
    try:
        return builder.build(
            messages, tools=list(tools) or None, enable_thinking=chat.enable_thinking
        )
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 -- the template's own complaint, as a 400
        # a template's raise_exception ("roles must alternate") is for the client; any
        # other error names our internals, so it is said without them
        said = f": {e}" if type(e).__module__.startswith("jinja2") else ""
        if not said:  # not the template's own words: ours, or the tokenizer's; logged
            traceback.print_exc(file=sys.stderr)
        raise APIError(
            f"the chat template cannot render these messages{said}", param=chat.param
        ) from None


def build_prompt(state: ServeState, chat: ChatRequest) -> tuple[Prompt, ReplyFormat, bool]:
    """The prompt of ``chat`` (on a worker thread: templates and tokenizers are slow),
    the model's reply format, and whether a call is forced. Raises :class:`APIError`."""
    tokenizer = state.engine.tokenizer
    fmt = ReplyFormat.of(tokenizer)
    tools = _tools_for(chat)
    if chat.tools and not template_supports_tools(tokenizer):
        raise APIError(
            f"the chat template of {state.engine.model_name} has no tool support",
            param="tools",
            code="tools_not_supported",
        )
    prompt = _build(state, chat, tools)
    forced = bool(tools) and chat.tool_choice == "required" and bool(fmt.tool_call_start)
    if forced:
        start = tuple(tokenizer.encode(fmt.tool_call_start, add_special_tokens=False))
        prompt = Prompt(
            prompt.token_ids + start,
            prompt.boundaries,
            prompt.text + fmt.tool_call_start,
            prompt.spliced,
            prompt.canonical,
            prompt.fallback,
        )
    return prompt, fmt, forced


def _tools_for(chat: ChatRequest) -> tuple[dict[str, Any], ...]:
    if chat.forced_tool is None:
        return chat.tools
    named = tuple(t for t in chat.tools if t["function"]["name"] == chat.forced_tool)
    if not named:
        raise APIError(
            f"tool_choice names {chat.forced_tool!r}, which is not in 'tools'",
            param="tool_choice",
        )
    return named


async def prepare(state: ServeState, http: Request, chat: ChatRequest) -> Prepared:
    """Build and check ``chat``'s prompt and make its :class:`GenerateRequest`. Raises
    :class:`APIError` (bad messages, context exceeded, queue full) or
    :class:`ClientGone` (the client left while its prompt was built)."""
    if len(chat.messages) > state.limits.max_messages:
        raise APIError(
            f"{len(chat.messages)} messages is more than this server takes "
            f"({state.limits.max_messages})",
            param=chat.param,
            code="too_many_messages",
        )
    prompt, fmt, forced = await off_loop(state, http, build_prompt, state, chat)
    ids = prompt.token_ids
    params = chat.sampling
    context = context_length(state.engine)
    max_tokens = params.max_tokens
    explicit = chat.max_tokens_explicit
    if chat.clamp_max_tokens and context is not None:
        max_tokens = max(1, min(max_tokens, context - len(ids)))
        explicit = False
    max_tokens = check_prompt(
        ids,
        max_tokens,
        explicit=explicit,
        # a chat prompt holds ids of the tokenizer and ids the model generated (the reply
        # memory): only the model's own bound can judge the latter
        vocab=model_vocab(state.engine),
        context=context,
        param=chat.param,
    )
    if await http.is_disconnected():  # gone while its prompt was built: queue nothing
        raise ClientGone("while its prompt was built")
    check_queue(state)
    request = engine_request(state, ids, params, max_tokens, prompt.boundaries)
    # the reply starts inside a think block when the prompt opened one it did not close
    # (a template's generation prompt with ``<think>``), as mlx-lm's server reads it
    text = prompt.text
    in_reasoning = bool(fmt.think_start) and text.rfind(fmt.think_start) > text.rfind(
        fmt.think_end or fmt.think_start
    )
    tools = _tools_for(chat)
    return Prepared(
        request=request,
        prompt=prompt,
        fmt=fmt,
        tools=tools,
        parse_tools=bool(tools) and chat.tool_choice != "none",
        max_calls=None if chat.parallel_tool_calls else 1,
        in_reasoning=in_reasoning and not forced,
        forced_call=forced,
    )


def check_queue(state: ServeState) -> None:
    """Raise :class:`APIError` 503 ``queue_full`` (with ``Retry-After``) when the engine
    already has ``state.max_queue`` requests waiting."""
    waiting = state.engine.queue_depth
    if waiting >= state.max_queue:
        raise APIError(
            f"the engine queue is full ({waiting} requests)",
            503,
            "server_error",
            code="queue_full",
            retry_after_s=1,
        )


def engine_request(
    state: ServeState,
    ids: tuple[int, ...],
    params: SamplingParams,
    max_tokens: int,
    boundaries: tuple[tuple[int, str], ...] = (),
) -> GenerateRequest:
    """The engine's request for checked prompt ``ids`` and ``params``, with the reply's
    ``max_tokens`` as checked against the context; its ``stop`` strings go to the engine,
    which ends the reply before them (docs/DESIGN.md §2 "Sampling")."""
    sampling = dataclasses.replace(params, max_tokens=max_tokens)
    return GenerateRequest(ids, sampling, boundaries, state.use_cache)


async def admitted(
    state: ServeState,
    http: Request,
    work: Callable[[], Awaitable[T]],
    error_response: Callable[[APIError], Response],
) -> T | Response:
    """``await work()`` (read, convert and prepare one request), or the response that
    refuses the request in the API's own error shape (``error_response``): its
    :class:`APIError`, 499 (and one log line) for a client gone while its body was read
    or its prompt built, a 500 naming
    nothing of the server for any other exception (the traceback goes to the log), 503
    ``server_shutting_down`` while the server drains (checked before and after)."""
    if state.draining:
        return error_response(shutting_down())
    try:
        result = await work()
    except APIError as e:
        return error_response(e)
    except ClientGone as e:
        return client_gone(http, e)
    except Exception:  # noqa: BLE001 -- a bug of ours: logged, a 500 without internals
        traceback.print_exc(file=sys.stderr)
        return error_response(internal_error())
    if state.draining:  # a signal came while the prompt was built
        return error_response(shutting_down())
    return result
