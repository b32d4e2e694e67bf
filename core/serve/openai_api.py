"""The OpenAI adapter of ``tierchat serve``: ``POST /v1/chat/completions`` (tools, tool
calls, reasoning) and ``POST /v1/completions`` in OpenAI's wire format, whole or streamed
(docs/DESIGN.md §15).

A chat body becomes the one internal :class:`~tierchat.core.serve.request.ChatRequest`;
the reply's parts (:mod:`tierchat.core.serve.reply`) become a ``chat.completion`` object
or ``chat.completion.chunk`` events: ``content``, ``reasoning_content`` (the think block,
never mixed into ``content``), ``tool_calls`` (streamed as a first delta with the call's
id and name, then its ``arguments`` in pieces) and ``finish_reason`` ``tool_calls`` /
``length`` / ``stop``. Streams send ``: keep-alive`` comments while a request waits or
prefills.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat.prompts import Prompt
from ..chat.tool_calls import ReasoningDelta, ReplyFormat, TextDelta, ToolCall, ToolCallDelta
from .generation import ClientGone, Generation, KeepAlive, off_loop
from .limits import check_prompt, context_length, vocab_size
from .prompts import APIError, completion_prompt, sampling, stream_options
from .replies import error_response, sse, usage
from .reply import ReplyEnd, read_reply
from .request import (
    ChatRequest,
    Prepared,
    admitted,
    check_queue,
    check_tool_calls,
    check_tools,
    engine_request,
    prepare,
    receive,
)
from .state import ServeState, client_label

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
KEEPALIVE = ": keep-alive\n\n"
ARGUMENT_PIECE = 64  # characters of a call's arguments per streamed delta


def text_content(content: Any, param: str) -> str:
    """A message's ``content``: a string, or a list of ``{"type": "text", "text": ...}``
    parts (joined). Raises :class:`APIError` for other parts (images, audio)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") in (
                "text",
                "input_text",
                "output_text",
            ):
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise APIError(
                    f"content part of type {kind!r} is not supported", param=f"{param}.{i}"
                )
        return "".join(parts)
    raise APIError("content must be a string or a list of text parts", param=param)


def chat_messages(raw: Any) -> tuple[dict[str, Any], ...]:
    """A chat body's ``messages`` in the internal form. Raises :class:`APIError`."""
    if not isinstance(raw, list) or not raw:
        raise APIError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping):
            raise APIError(f"messages[{i}] must be an object", param=f"messages.{i}")
        given = m.get("role")
        role = ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise APIError(
                f"messages[{i}].role {str(given)[:40]!r} is not supported "
                "(system, developer, user, assistant, tool)",
                param=f"messages.{i}.role",
            )
        msg: dict[str, Any] = {
            "role": role,
            "content": text_content(m.get("content"), f"messages.{i}.content"),
        }
        if role == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = check_tool_calls(m["tool_calls"], f"messages.{i}.tool_calls")
            for key in ("reasoning_content", "reasoning"):
                if isinstance(m.get(key), str) and m[key]:
                    msg["reasoning_content"] = m[key]
                    break
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise APIError(
                    "a tool message needs its tool_call_id", param=f"messages.{i}.tool_call_id"
                )
            msg["tool_call_id"] = call_id
        out.append(msg)
    return tuple(out)


def tool_choice(body: Mapping[str, Any]) -> tuple[str, str | None]:
    """``(choice, forced name)`` of OpenAI's ``tool_choice``: ``auto`` (the default),
    ``none``, ``required``, or ``{"type": "function", "function": {"name"}}``."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
        if isinstance(name, str) and name:
            return "required", name
    raise APIError(
        "'tool_choice' must be auto, none, required or a named function", param="tool_choice"
    )


def chat_request(body: Mapping[str, Any], state: ServeState) -> ChatRequest:
    """The internal request of a ``/v1/chat/completions`` body. Raises :class:`APIError`."""
    params = sampling(body, state.sampling)
    stream, include_usage = stream_options(body)
    tools = check_tools(body.get("tools"))
    choice, forced = tool_choice(body) if tools else ("none", None)
    parallel = body.get("parallel_tool_calls", True)
    kwargs = body.get("chat_template_kwargs")
    thinking = kwargs.get("enable_thinking") if isinstance(kwargs, Mapping) else None
    return ChatRequest(
        messages=chat_messages(body.get("messages")),
        sampling=params,
        stream=stream,
        include_usage=include_usage,
        tools=tools,
        tool_choice=choice,  # type: ignore[arg-type]
        forced_tool=forced,
        parallel_tool_calls=parallel is not False,
        enable_thinking=thinking if isinstance(thinking, bool) else None,
        max_tokens_explicit=any(
            body.get(k) is not None for k in ("max_tokens", "max_completion_tokens")
        ),
    )


def _call_json(index: int, call: ToolCall) -> dict[str, Any]:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


async def chat_completions(state: ServeState, http: Request) -> Response:
    """``POST /v1/chat/completions``."""
    return await _generate(state, http, chat=True)


async def completions(state: ServeState, http: Request) -> Response:
    """``POST /v1/completions``: a raw prompt (text or ids), no template, no tools."""
    return await _generate(state, http, chat=False)


async def _prepare_completion(state: ServeState, http: Request, body: dict) -> Prepared:
    if body.get("echo"):
        raise APIError("echo is not supported", param="echo")
    if body.get("suffix"):
        raise APIError("suffix is not supported", param="suffix")
    params = sampling(body, state.sampling)
    builder = state.builder()
    ids = await off_loop(state, http, completion_prompt, builder.tokenizer, body)
    max_tokens = check_prompt(
        ids,
        params.max_tokens,
        explicit=body.get("max_tokens") is not None,
        vocab=vocab_size(state.engine),
        context=context_length(state.engine),
        param="prompt",
    )
    if await http.is_disconnected():
        raise ClientGone("while its prompt was built")
    check_queue(state)
    request = engine_request(state, ids, params, max_tokens)
    return Prepared(
        request=request, prompt=Prompt(ids, ()), fmt=ReplyFormat(None, None, None, None, None)
    )


async def _generate(state: ServeState, http: Request, chat: bool) -> Response:
    async def work() -> tuple[dict, tuple[bool, bool], Prepared]:
        body = await receive(state, http)
        flags = stream_options(body)
        if chat:
            return body, flags, await prepare(state, http, chat_request(body, state))
        return body, flags, await _prepare_completion(state, http, body)

    got = await admitted(state, http, work, error_response)
    if isinstance(got, Response):
        return got
    body, (stream, include_usage), prep = got
    endpoint = "chat" if chat else "completion"
    gen = Generation(state, prep.request, client_label(http, body), endpoint)
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    head = {"id": ident, "created": int(time.time()), "model": state.engine.model_name}
    if stream:
        return StreamingResponse(
            _stream(state, gen, prep, include_usage, chat, head),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _whole(state, gen, prep, http, chat, head)


async def _whole(
    state: ServeState,
    gen: Generation,
    prep: Prepared,
    http: Request,
    chat: bool,
    head: dict,
) -> Response:
    async for event in read_reply(state, gen, prep, http):
        if isinstance(event, APIError):
            return error_response(event)
        if isinstance(event, ReplyEnd):
            if chat:
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": event.text if event.text or not event.calls else None,
                }
                if event.reasoning:
                    message["reasoning_content"] = event.reasoning
                if event.calls:
                    message["tool_calls"] = [
                        {k: v for k, v in _call_json(i, c).items() if k != "index"}
                        for i, c in enumerate(event.calls)
                    ]
                choice = {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": event.finish_reason,
                }
                obj = "chat.completion"
            else:
                choice = {
                    "index": 0,
                    "text": event.text,
                    "logprobs": None,
                    "finish_reason": event.finish_reason,
                }
                obj = "text_completion"
            return JSONResponse(
                {
                    **head,
                    "object": obj,
                    "choices": [choice],
                    "usage": usage(event.metrics, event.completion_tokens),
                }
            )
    return Response(status_code=499)  # the client went away


async def _stream(
    state: ServeState,
    gen: Generation,
    prep: Prepared,
    include_usage: bool,
    chat: bool,
    head: dict,
) -> AsyncIterator[str]:
    """``chat.completion.chunk`` events (a first one with the role) or ``text_completion``
    chunks, the last with the finish reason, the usage chunk when
    ``stream_options.include_usage`` asks, then ``data: [DONE]``; a failure is an error
    event. A client's disconnect closes this generator, which cancels the request."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict[str, Any] | None = None, text: str = "", reason: str | None = None):
        if chat:
            choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return sse({**head, "object": obj, "choices": [choice], **extra})

    if chat:
        yield chunk({"role": "assistant", "content": ""})
    async for event in read_reply(state, gen, prep, keepalive=True):
        if isinstance(event, KeepAlive):
            yield KEEPALIVE
        elif isinstance(event, TextDelta):
            yield chunk({"content": event.text}, text=event.text)
        elif isinstance(event, ReasoningDelta) and chat:
            yield chunk({"reasoning_content": event.text})
        elif isinstance(event, ToolCallDelta) and chat:
            call = event.call
            head_delta = _call_json(event.index, call)
            head_delta["function"] = {"name": call.name, "arguments": ""}
            yield chunk({"tool_calls": [head_delta]})
            args = call.arguments
            for k in range(0, len(args), ARGUMENT_PIECE):
                piece = {
                    "index": event.index,
                    "function": {"arguments": args[k : k + ARGUMENT_PIECE]},
                }
                yield chunk({"tool_calls": [piece]})
        elif isinstance(event, APIError):
            yield sse(event.body())
        elif isinstance(event, ReplyEnd):
            yield chunk({}, reason=event.finish_reason)
            if include_usage:
                u = usage(event.metrics, event.completion_tokens)
                yield sse({**head, "object": obj, "choices": [], "usage": u})
    yield "data: [DONE]\n\n"
