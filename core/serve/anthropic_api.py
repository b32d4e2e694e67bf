"""The Anthropic adapter of ``tierchat serve``: ``POST /v1/messages`` (whole or streamed)
and ``POST /v1/messages/count_tokens`` in the Messages API's wire format
(docs.anthropic.com, "Messages" and "Streaming Messages"; docs/DESIGN.md §15).

A body becomes the one internal :class:`~tierchat.core.serve.request.ChatRequest`:

- ``system`` (a string or text blocks) is one system message, first (none when it is
  empty, as when it is absent); blocks are joined with ``"\\n\\n"``. Text blocks of any
  message are joined the same way, so a replay that sends the same conversation through
  another API must join its parts with a blank line to get the same ids.
- ``system`` messages in ``messages`` (Claude Code sends them mid-conversation) stay
  system messages where the client put them: tiny models' and Qwen2.5's templates render
  a system turn anywhere; a template that refuses is the client's 400.
- A user message's ``tool_result`` blocks become ``tool`` messages (``tool_call_id`` =
  ``tool_use_id``), in their order and before the message's text, which follows as one
  user message (none when a message holds only results). ``is_error: true`` prefixes the
  result with ``"Error: "`` so the model sees it failed.
- An assistant message's ``tool_use`` blocks become ``tool_calls`` (``arguments`` =
  ``json.dumps(input, ensure_ascii=False)``), its ``thinking`` blocks
  ``reasoning_content``, its text blocks ``content``; ``redacted_thinking`` is dropped.
- ``image`` and ``document`` blocks are a 400; ``cache_control`` is ignored everywhere,
  as are ``metadata``, ``context_management``, ``output_config``, ``service_tier``,
  ``container``, ``mcp_servers`` and the ``anthropic-*`` headers.
- ``tools`` become OpenAI function tools; server tools (a ``type`` other than
  ``custom``: ``web_search_20250305``, ``bash_20250124``) are skipped with a log line.
  ``tool_choice`` ``auto``/``any``/``tool``/``none`` is auto/required/forced/none.
- ``max_tokens`` is required and clamped to what the context leaves (clients send
  32,000 whatever the model); ``thinking`` enabled/adaptive/disabled is the template's
  thinking switch on/default/off. ``temperature`` defaults to the server's 0 (greedy),
  as on the OpenAI routes, not to Anthropic's 1.

The reply's parts (:mod:`tierchat.core.serve.reply`) become a ``message`` with
``thinking``, ``text`` and ``tool_use`` blocks (a call's id ``call_x`` is sent as
``toolu_x``), or the stream's events: ``message_start``, ``ping``, per block
``content_block_start``/``_delta``/``_stop``, ``message_delta``, ``message_stop``, and a
``ping`` for each keep-alive while the request waits or prefills. ``usage``:
``input_tokens`` is the prefilled tokens, ``cache_read_input_tokens`` the cached ones;
``message_start`` cannot know the split yet and counts the whole prompt as input, which
the final ``message_delta`` corrects. Errors are ``{"type": "error", "error": {"type",
"message"}}`` with the internal error's HTTP status (a 503 is ``overloaded_error``, still
503) and its ``Retry-After``; in a stream, an ``error`` event.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat.tool_calls import ReasoningDelta, TextDelta, ToolCall, ToolCallDelta
from ..sampling_params import SamplingParams
from ..text import log_safe
from .generation import Generation, KeepAlive, off_loop
from .prompts import APIError, sampling_params
from .reply import ReplyEnd, read_reply
from .request import (
    ChatRequest,
    Prepared,
    admitted,
    build_prompt,
    check_tools,
    prepare,
    receive,
)
from .state import ServeState, client_label

BLOCK_JOIN = "\n\n"  # between the text blocks of one system prompt, message or result
ERROR_PREFIX = "Error: "  # a tool_result with is_error: true
ARGUMENT_PIECE = 64  # characters of a call's input per input_json_delta
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
THINKING = {"enabled": True, "adaptive": None, "disabled": False}
TOOL_CHOICE = {"auto": "auto", "any": "required", "tool": "required", "none": "none"}


# ---------------------------------------------------------------- body -> request


def _blocks(content: Any, param: str) -> list[Mapping[str, Any]]:
    """``content`` as a list of blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise APIError("content must be a string or a list of content blocks", param=param)
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if not isinstance(kind, str):
            raise APIError("each content block must be an object with a type", param=f"{param}.{i}")
        if kind in ("image", "document"):
            raise APIError(
                f"{kind} blocks are not supported: this server's models read text only "
                "(images and documents are not supported)",
                param=f"{param}.{i}",
            )
    return content


def _text(blocks: list[Mapping[str, Any]], param: str) -> str:
    texts = []
    for i, block in enumerate(blocks):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise APIError(
                f"a content block of type {str(block['type'])[:40]!r} is not allowed here",
                param=f"{param}.{i}",
            )
        texts.append(block["text"])
    return BLOCK_JOIN.join(texts)


def system_text(system: Any) -> str:
    """The ``system`` field's text: a string, or its text blocks joined with a blank line."""
    return _text(_blocks(system, "system"), "system")


def _tool_result(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise APIError("a tool_result needs its tool_use_id", param=f"{param}.tool_use_id")
    content = block.get("content") or ""
    text = _text(_blocks(content, f"{param}.content"), f"{param}.content")
    if block.get("is_error") is True:
        text = ERROR_PREFIX + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _user(blocks: list[Mapping[str, Any]], param: str) -> list[dict[str, Any]]:
    out, rest = [], []
    for i, block in enumerate(blocks):
        if block["type"] == "tool_result":
            out.append(_tool_result(block, f"{param}.{i}"))
        elif block["type"] == "text":
            rest.append(block)
        else:
            raise APIError(
                f"a content block of type {str(block['type'])[:40]!r} is not allowed in a "
                "user message",
                param=f"{param}.{i}",
            )
    if rest or not out:
        out.append({"role": "user", "content": _text(rest, param)})
    return out


def _assistant(blocks: list[Mapping[str, Any]], param: str) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for i, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            name, args, ident = block.get("name"), block.get("input", {}), block.get("id")
            if not isinstance(name, str) or not name or not isinstance(args, Mapping):
                raise APIError("a tool_use needs a name and an input object", param=f"{param}.{i}")
            if not isinstance(ident, str) or not ident:
                raise APIError("a tool_use needs its id", param=f"{param}.{i}.id")
            arguments = json.dumps(args, ensure_ascii=False)
            calls.append(
                {
                    "id": ident,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        else:
            raise APIError(
                f"a content block of type {str(kind)[:40]!r} is not allowed in an assistant "
                "message",
                param=f"{param}.{i}",
            )
    msg: dict[str, Any] = {"role": "assistant", "content": BLOCK_JOIN.join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = BLOCK_JOIN.join(thoughts)
    return msg


def convert_messages(system: Any, raw: Any) -> tuple[dict[str, Any], ...]:
    """``system`` and ``messages`` of a body in the internal form (module docstring).
    Raises :class:`APIError` 400."""
    if not isinstance(raw, list) or not raw:
        raise APIError("'messages' must be a non-empty list", param="messages")
    text = system_text(system) if system is not None else ""
    out = [{"role": "system", "content": text}] if text else []
    for i, m in enumerate(raw):
        param = f"messages.{i}"
        role = m.get("role") if isinstance(m, Mapping) else None
        if role not in ("user", "assistant", "system"):
            raise APIError(
                f"messages[{i}].role must be user, assistant or system", param=f"{param}.role"
            )
        blocks = _blocks(m.get("content"), f"{param}.content")
        if role == "user":
            out.extend(_user(blocks, f"{param}.content"))
        elif role == "assistant":
            out.append(_assistant(blocks, f"{param}.content"))
        else:
            out.append({"role": "system", "content": _text(blocks, f"{param}.content")})
    return tuple(out)


def convert_tools(raw: Any) -> tuple[dict[str, Any], ...]:
    """Anthropic tools as checked OpenAI function tools; server tools are skipped (logged)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise APIError("'tools' must be a list", param="tools")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, Mapping):
            raise APIError("each tool must be an object", param=f"tools.{i}")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            print(f"anthropic: server tool {log_safe(str(kind)[:60])} skipped", file=sys.stderr)
            continue
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, Mapping):
            raise APIError(
                "a tool's input_schema must be an object", param=f"tools.{i}.input_schema"
            )
        fn = {
            "name": tool.get("name"),
            "description": tool.get("description", ""),
            "parameters": dict(schema),
        }
        tools.append({"type": "function", "function": fn})
    return check_tools(tools)


def _tool_choice(raw: Any) -> tuple[str, str | None, bool]:
    """``(choice, forced name, parallel)`` of Anthropic's ``tool_choice``."""
    if raw is None:
        return "auto", None, True
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if kind not in TOOL_CHOICE:
        raise APIError("'tool_choice.type' must be auto, any, tool or none", param="tool_choice")
    name = raw.get("name") if kind == "tool" else None
    if kind == "tool" and (not isinstance(name, str) or not name):
        raise APIError("tool_choice of type tool needs a name", param="tool_choice.name")
    return TOOL_CHOICE[kind], name, raw.get("disable_parallel_tool_use") is not True


def _sampling(body: Mapping[str, Any], state: ServeState, count_only: bool) -> SamplingParams:
    if body.get("max_tokens") is None and not count_only:
        raise APIError("'max_tokens' is required", param="max_tokens")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list):
        raise APIError("'stop_sequences' must be a list of strings", param="stop_sequences")
    values = {k: body.get(k) for k in ("max_tokens", "temperature", "top_p", "top_k")}
    names = {"stop": "stop_sequences"}
    return sampling_params({**values, "stop": stops}, state.sampling, names)


def _stream_flag(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError("'stream' must be a boolean", param="stream")
    return stream


def chat_request(
    body: Mapping[str, Any], state: ServeState, count_only: bool = False
) -> ChatRequest:
    """The internal request of a ``/v1/messages`` body (``count_only``: of a
    ``count_tokens`` body, which has no ``max_tokens``). Raises :class:`APIError` 400."""
    params = _sampling(body, state, count_only)
    tools = convert_tools(body.get("tools"))
    choice, forced, parallel = _tool_choice(body.get("tool_choice"))
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    if thinking is not None and kind not in THINKING:
        raise APIError("'thinking.type' must be enabled, adaptive or disabled", param="thinking")
    return ChatRequest(
        messages=convert_messages(body.get("system"), body.get("messages")),
        sampling=params,
        stream=_stream_flag(body),
        tools=tools,
        tool_choice=choice if tools else "none",  # type: ignore[arg-type]
        forced_tool=forced if tools else None,
        parallel_tool_calls=parallel,
        enable_thinking=THINKING.get(kind),
        clamp_max_tokens=True,
    )


# ---------------------------------------------------------------- errors


def error_body(e: APIError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


# ---------------------------------------------------------------- reply


def tool_use_id(call: ToolCall) -> str:
    """The call's id as Anthropic spells it: ``call_x`` is sent as ``toolu_x``."""
    return "toolu_" + call.id.removeprefix("call_")


def _tool_use(call: ToolCall, whole: bool = True) -> dict[str, Any]:
    args = json.loads(call.arguments) if whole else {}
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": args}


def stop_reason(end: ReplyEnd) -> str:
    if end.finish_reason == "tool_calls":
        return "tool_use"
    if end.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if end.stop_sequence is not None else "end_turn"


def usage(end: ReplyEnd) -> dict[str, int]:
    m = end.metrics
    return {
        "input_tokens": m.prompt_tokens - m.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": m.cached_tokens,
        "output_tokens": end.completion_tokens,
    }


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event: ``event: <kind>`` and its JSON (which repeats the kind)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


async def messages(state: ServeState, http: Request) -> Response:
    """``POST /v1/messages``."""

    async def work() -> tuple[dict, ChatRequest, Prepared]:
        body = await receive(state, http)
        chat = chat_request(body, state)
        return body, chat, await prepare(state, http, chat)

    got = await admitted(state, http, work, error_response)
    if isinstance(got, Response):
        return got
    body, chat, prep = got
    gen = Generation(state, prep.request, client_label(http, body), "messages")
    head = {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "type": "message",
        "role": "assistant",
        "model": state.engine.model_name,
    }
    if chat.stream:
        return StreamingResponse(
            _stream(state, gen, prep, head),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    async for part in read_reply(state, gen, prep, http):
        if isinstance(part, APIError):
            return error_response(part)
        if isinstance(part, ReplyEnd):
            content: list[dict[str, Any]] = []
            if part.reasoning:
                content.append({"type": "thinking", "thinking": part.reasoning, "signature": ""})
            if part.text or not (part.reasoning or part.calls):
                content.append({"type": "text", "text": part.text})
            content += [_tool_use(c) for c in part.calls]
            return JSONResponse(
                {
                    **head,
                    "content": content,
                    "stop_reason": stop_reason(part),
                    "stop_sequence": part.stop_sequence,
                    "usage": usage(part),
                }
            )
    return Response(status_code=499)  # the client went away


async def _stream(
    state: ServeState, gen: Generation, prep: Prepared, head: dict
) -> AsyncIterator[str]:
    """The stream's events (module docstring). A block is opened by its first delta and
    closed when a part of another kind comes; a call is one whole block. A client's
    disconnect closes this generator, which cancels the request."""
    start_usage = {
        "input_tokens": len(prep.request.prompt_ids),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    message = {**head, "content": [], "stop_reason": None, "stop_sequence": None}
    yield event("message_start", {"message": {**message, "usage": start_usage}})
    yield event("ping", {})
    index, open_kind = -1, None

    def close() -> list[str]:
        nonlocal open_kind
        out = []
        if open_kind == "thinking":
            delta = {"type": "signature_delta", "signature": ""}
            out.append(event("content_block_delta", {"index": index, "delta": delta}))
        if open_kind is not None:
            out.append(event("content_block_stop", {"index": index}))
        open_kind = None
        return out

    def delta(kind: str, text: str) -> list[str]:
        nonlocal index, open_kind
        out = []
        if open_kind != kind:
            out += close()
            index, open_kind = index + 1, kind
            block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
            out.append(event("content_block_start", {"index": index, "content_block": block}))
        piece = {"type": f"{kind}_delta", kind: text}
        out.append(event("content_block_delta", {"index": index, "delta": piece}))
        return out

    async for part in read_reply(state, gen, prep, keepalive=True):
        if isinstance(part, KeepAlive):
            yield event("ping", {})
        elif isinstance(part, TextDelta):
            for frame in delta("text", part.text):
                yield frame
        elif isinstance(part, ReasoningDelta):
            for frame in delta("thinking", part.text):
                yield frame
        elif isinstance(part, ToolCallDelta):
            for frame in close():
                yield frame
            index += 1
            block = _tool_use(part.call, whole=False)
            yield event("content_block_start", {"index": index, "content_block": block})
            args = part.call.arguments
            for k in range(0, len(args), ARGUMENT_PIECE):
                piece = {"type": "input_json_delta", "partial_json": args[k : k + ARGUMENT_PIECE]}
                yield event("content_block_delta", {"index": index, "delta": piece})
            yield event("content_block_stop", {"index": index})
        elif isinstance(part, APIError):
            yield event("error", {"error": error_body(part)["error"]})
        elif isinstance(part, ReplyEnd):
            for frame in close():
                yield frame
            end = {"stop_reason": stop_reason(part), "stop_sequence": part.stop_sequence}
            yield event("message_delta", {"delta": end, "usage": usage(part)})
            yield event("message_stop", {})


async def count_tokens(state: ServeState, http: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's length as ``messages`` would build
    it (tools, thinking switch, a forced call's start marker); nothing is queued."""

    async def work():
        chat = chat_request(await receive(state, http), state, count_only=True)
        return await off_loop(state, http, build_prompt, state, chat)

    got = await admitted(state, http, work, error_response)
    if isinstance(got, Response):
        return got
    prompt, _, _ = got
    return JSONResponse({"input_tokens": len(prompt.token_ids)})
