"""The OpenAI Responses adapter of ``tierchat serve``: ``POST /v1/responses`` (whole or
streamed) and ``GET /v1/responses/{id}`` (docs/DESIGN.md §15).

A body becomes the one internal :class:`~tierchat.core.serve.request.ChatRequest`
(:mod:`tierchat.core.serve.responses_input`), with the messages the same conversation has
in OpenAI chat form, so both APIs give the same prompt ids: ``instructions`` is a first system message; ``input`` a string (one user
message) or items: messages (``developer`` is ``system``; text parts only, an image or
file part is a 400), ``function_call`` items (the ``tool_calls`` of the assistant message
before them, or of a new one), ``function_call_output`` items (``tool`` messages) and
``reasoning`` items (the ``reasoning_content`` of the next assistant message; encrypted
content is ignored). ``previous_response_id`` puts a stored response's input and output
before this input (:mod:`tierchat.core.serve.response_store`; its instructions are not
carried over, as OpenAI does). Function tools (the flat form) become OpenAI chat's;
other tools (Codex's ``web_search``) are skipped with a line on stderr. ``reasoning.effort``
``none`` or ``minimal`` turns the template's thinking off; other efforts keep its default.
``include``, ``prompt_cache_key``, ``truncation``, ``metadata``, ``service_tier``,
``user`` and ``safety_identifier`` are accepted and ignored; a ``text.format`` other than
text is a 400.

The reply's parts become output items (``reasoning`` with a summary, ``message`` with
``output_text``, ``function_call``) and, streamed, the events OpenAI's SDK parses
(``response.created`` … ``response.completed`` or ``response.incomplete``, each with its
``sequence_number``); a failure mid-stream is ``response.failed``. A ``keepalive`` event
(``{"type": "keepalive", "sequence_number": n}``, as OpenAI's own service sends on long
streams: openai/openai-node#1964) keeps a stream open while a request waits, prefills or
writes a tool call: an SSE comment would not do, since Codex's idle timer (300 s) counts
events and its SSE reader drops comments.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat.tool_calls import ReasoningDelta, TextDelta, ToolCallDelta
from .generation import Generation, KeepAlive
from .guard import authorize
from .openai_api import ARGUMENT_PIECE
from .prompts import APIError
from .replies import error_response, usage
from .reply import ReplyEnd, read_reply
from .request import ChatRequest, Prepared, admitted, prepare, receive
from .response_store import new_response_id
from .responses_input import chat_request, input_items
from .state import ServeState, client_label

# ---------------------------------------------------------------- the response object


def _usage(end: ReplyEnd) -> dict[str, Any]:
    u = usage(end.metrics, end.completion_tokens)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
        "tierchat": u["tierchat"],
    }


class Reply:
    """One response being made: its id, echoed settings and output items."""

    def __init__(self, state: ServeState, body: Mapping[str, Any], store: bool) -> None:
        self.id = new_response_id()
        self.created_at = int(time.time())
        self.body, self.model, self.store = body, state.engine.model_name, store
        self.output: list[dict[str, Any]] = []

    def obj(self, status: str, end: ReplyEnd | None = None, error: APIError | None = None) -> dict:
        b = self.body
        cut = end is not None and end.finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": self.output,
            "error": {"code": error.code or "server_error", "message": error.message}
            if error
            else None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": _usage(end) if end is not None else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "metadata": b.get("metadata") or {},
            "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"), "summary": None},
            "store": self.store,
            "temperature": b.get("temperature", 0.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice") or "auto",
            "tools": [t for t in b.get("tools") or [] if isinstance(t, Mapping)],
            "top_p": b.get("top_p", 1.0),
            "truncation": b.get("truncation") or "disabled",
            "user": b.get("user"),
        }


def output_items(end: ReplyEnd) -> list[dict[str, Any]]:
    """The output items of a whole reply: reasoning, message, function calls."""
    items: list[dict[str, Any]] = []
    if end.reasoning:
        items.append(_reasoning_item(end.reasoning))
    if end.text or not end.calls:
        items.append(
            _message_item(end.text, "incomplete" if end.finish_reason == "length" else "completed")
        )
    items += [_call_item(c.id, c.name, c.arguments) for c in end.calls]
    return items


def _reasoning_item(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": "rs_" + uuid.uuid4().hex,
        "summary": [{"type": "summary_text", "text": text}],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [_text_part(text)] if status != "in_progress" else []
    ident = "msg_" + uuid.uuid4().hex
    return {
        "type": "message",
        "id": ident,
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(
    call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    ident = "fc_" + uuid.uuid4().hex
    return {
        "type": "function_call",
        "id": ident,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


# ---------------------------------------------------------------- routes


async def retrieve(state: ServeState, http: Request) -> Response:
    """``GET /v1/responses/{response_id}``: a stored response, else a 404."""
    try:
        authorize(state, http)
        if state.responses is None:
            raise APIError("this server stores no responses", 404, code="not_found")
        record = await _off(state.responses.load, http.path_params["response_id"])
    except APIError as e:
        return error_response(e)
    return JSONResponse(record["response"])


async def _off(fn, *args):
    return await run_in_threadpool(fn, *args)


async def create(state: ServeState, http: Request) -> Response:
    """``POST /v1/responses``."""

    async def work() -> tuple[dict, list, ChatRequest, Prepared]:
        body = await receive(state, http)
        items = input_items(body)
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str) or state.responses is None:
                raise APIError(
                    f"response {str(previous)[:64]!r} was not found (this server stores no responses)",
                    404,
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            record = await _off(state.responses.load, previous, "previous_response_id")
            items = record["input"] + record["output"] + items
        chat = chat_request(body, items, state)
        return body, items, chat, await prepare(state, http, chat)

    got = await admitted(state, http, work, error_response)
    if isinstance(got, Response):
        return got
    body, items, chat, prep = got
    store = body.get("store", True) is not False and state.responses is not None
    reply = Reply(state, body, store)
    gen = Generation(state, prep.request, client_label(http, body), "responses")
    if chat.stream:
        return StreamingResponse(
            _stream(state, gen, prep, reply, items),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    async for event in read_reply(state, gen, prep, http):
        if isinstance(event, APIError):
            return error_response(event)
        if isinstance(event, ReplyEnd):
            reply.output = output_items(event)
            return JSONResponse(await _finish(state, reply, items, event))
    return Response(status_code=499)  # the client went away


async def _finish(state: ServeState, reply: Reply, items: list, end: ReplyEnd) -> dict[str, Any]:
    """The final response object; stored first when the request asks (a failed write is
    logged: the reply still goes out)."""
    obj = reply.obj("incomplete" if end.finish_reason == "length" else "completed", end)
    if reply.store and state.responses is not None:
        try:
            record = {"input": items, "output": reply.output, "response": obj}
            await _off(state.responses.save, reply.id, record)
        except OSError as e:
            print(f"warning: response {reply.id} not stored: {e}", file=sys.stderr)
    return obj


def _event(kind: str, seq: int, data: dict[str, Any]) -> str:
    data = {"type": kind, "sequence_number": seq, **data}
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _stream(
    state: ServeState, gen: Generation, prep: Prepared, reply: Reply, items: list
) -> AsyncIterator[str]:
    """The Responses stream; a client's disconnect closes it, which cancels the request."""
    seq = iter(range(1 << 62))
    open_kind: str | None = None  # the kind of the last item while it is open
    text = ""

    def emit(kind: str, **data: Any) -> str:
        return _event(kind, next(seq), data)

    def where() -> dict[str, Any]:
        return {"item_id": reply.output[-1]["id"], "output_index": len(reply.output) - 1}

    def close(status: str = "completed") -> list[str]:
        nonlocal open_kind
        kind, open_kind, item = open_kind, None, reply.output[-1] if reply.output else None
        if kind == "reasoning":
            part = {"type": "summary_text", "text": text}
            item["summary"] = [part]
            return [
                emit("response.reasoning_summary_text.done", **where(), summary_index=0, text=text),
                emit("response.reasoning_summary_part.done", **where(), summary_index=0, part=part),
                emit("response.output_item.done", output_index=len(reply.output) - 1, item=item),
            ]
        if kind == "message":
            item["content"], item["status"] = [_text_part(text)], status
            return [
                emit(
                    "response.output_text.done", **where(), content_index=0, text=text, logprobs=[]
                ),
                emit(
                    "response.content_part.done", **where(), content_index=0, part=_text_part(text)
                ),
                emit("response.output_item.done", output_index=len(reply.output) - 1, item=item),
            ]
        return []

    def open_item(kind: str) -> list[str]:
        nonlocal open_kind, text
        if open_kind == kind:
            return []
        out = close()
        open_kind, text = kind, ""
        if kind == "reasoning":
            reply.output.append({**_reasoning_item(""), "summary": []})
            out.append(
                emit(
                    "response.output_item.added",
                    output_index=len(reply.output) - 1,
                    item=reply.output[-1],
                )
            )
            part = {"type": "summary_text", "text": ""}
            out.append(
                emit("response.reasoning_summary_part.added", **where(), summary_index=0, part=part)
            )
        else:
            reply.output.append(_message_item("", "in_progress"))
            out.append(
                emit(
                    "response.output_item.added",
                    output_index=len(reply.output) - 1,
                    item=reply.output[-1],
                )
            )
            out.append(
                emit("response.content_part.added", **where(), content_index=0, part=_text_part(""))
            )
        return out

    yield emit("response.created", response=reply.obj("in_progress"))
    yield emit("response.in_progress", response=reply.obj("in_progress"))
    async for event in read_reply(state, gen, prep, keepalive=True):
        if isinstance(event, KeepAlive):
            yield emit("keepalive")
        elif isinstance(event, ReasoningDelta | TextDelta):
            kind = "reasoning" if isinstance(event, ReasoningDelta) else "message"
            for line in open_item(kind):
                yield line
            text += event.text
            name = (
                "response.reasoning_summary_text.delta"
                if kind == "reasoning"
                else "response.output_text.delta"
            )
            extra = (
                {"summary_index": 0}
                if kind == "reasoning"
                else {"content_index": 0, "logprobs": []}
            )
            yield emit(name, **where(), **extra, delta=event.text)
        elif isinstance(event, ToolCallDelta):
            for line in close():
                yield line
            call = event.call
            reply.output.append(_call_item(call.id, call.name, "", "in_progress"))
            yield emit(
                "response.output_item.added",
                output_index=len(reply.output) - 1,
                item=reply.output[-1],
            )
            for k in range(0, len(call.arguments), ARGUMENT_PIECE):
                yield emit(
                    "response.function_call_arguments.delta",
                    **where(),
                    delta=call.arguments[k : k + ARGUMENT_PIECE],
                )
            yield emit("response.function_call_arguments.done", **where(), arguments=call.arguments)
            reply.output[-1].update(arguments=call.arguments, status="completed")
            yield emit(
                "response.output_item.done",
                output_index=len(reply.output) - 1,
                item=reply.output[-1],
            )
        elif isinstance(event, APIError):
            for line in close("incomplete"):
                yield line
            yield emit("response.failed", response=reply.obj("failed", error=event))
        elif isinstance(event, ReplyEnd):
            cut = event.finish_reason == "length"
            if not event.calls and not any(i["type"] == "message" for i in reply.output):
                for line in open_item("message"):
                    yield line
            for line in close("incomplete" if cut else "completed"):
                yield line
            obj = await _finish(state, reply, items, event)
            yield emit("response.incomplete" if cut else "response.completed", response=obj)
