"""What the routes of ``tierchat serve`` send back: OpenAI's reply objects built from the
engine's events, whole (one JSON object) or streamed (server-sent events), and its error
objects (docs/DESIGN.md §15).

``usage`` is OpenAI's (``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``prompt_tokens_details.cached_tokens``) plus ``usage.tierchat``: cached tokens by tier
(``cached_by``) and by entry kind (``cached_kind``), ``prefill_tokens``, ``ttft_s``,
``prefill_tps``, ``generation_tps``, ``ssd_write_bytes``. A reply cut at a ``stop`` string
is cancelled on the engine and counts only the tokens returned.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..api import Failed, Finished, TokenBatch, TurnMetrics
from .prompts import APIError, Sampling, StopMatcher, returned_tokens

if TYPE_CHECKING:
    from .app import ServeState
    from .generation import Generation


# ---------------------------------------------------------------- errors


def error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(e.retry_after_s)
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


def failure(event: Failed) -> APIError:
    if event.kind == "refused":  # the memory guard: not the prompt's fault, try later
        return APIError(
            event.message, 503, "server_error", code="insufficient_memory", retry_after_s=30
        )
    if event.kind == "cancelled":
        return APIError(event.message, 499, "server_error", code="cancelled")
    return APIError(event.message, 500, "server_error", code=event.kind)


def internal_error() -> APIError:
    """A 500 that names nothing of the server's code (the traceback goes to its log)."""
    return APIError("internal server error (details in the server's log)", 500, "server_error")


def shutting_down() -> APIError:
    return APIError("the server is shutting down", 503, "server_error", code="server_shutting_down")


# ---------------------------------------------------------------- replies


def usage(m: TurnMetrics, completion_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``completion_tokens``: the tokens returned (fewer than
    generated when a stop string cut the reply), default all generated."""
    n = m.generation_tokens if completion_tokens is None else completion_tokens
    return {
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": m.prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": m.cached_tokens},
        "tierchat": {
            "cached_by": dict(m.cached_by),
            "cached_kind": dict(m.cached_kind),
            "prefill_tokens": m.prefill_tokens,
            "ttft_s": round(m.ttft_s, 6),
            "prefill_tps": round(m.prefill_tps, 2),
            "generation_tps": round(m.generation_tps, 2),
            "ssd_write_bytes": m.ssd_write_bytes,
        },
    }


def stopped(state: ServeState, gen: Generation, matcher: StopMatcher) -> None:
    """A reply cut at a stop string was cancelled on the engine; the log shows it done."""
    seq = getattr(gen.handle, "log_seq", None)
    if matcher.stopped and seq is not None:
        state.log.update(seq, status="done", metrics_changes={"finish_reason": "stop"})


def _finish_reason(metrics: TurnMetrics, matcher: StopMatcher) -> str:
    if matcher.stopped:
        return "stop"
    return "length" if metrics.finish_reason == "length" else "stop"


async def whole_reply(
    state: ServeState,
    gen: Generation,
    http: Request,
    params: Sampling,
    endpoint: str,
    head: dict,
) -> Response:
    """The reply as one ``chat.completion`` / ``text_completion`` object once the engine
    finishes; an error object if it fails; 499 if the client leaves first."""
    matcher = StopMatcher(params.stop)
    async for event in gen.events(http):
        if isinstance(event, TokenBatch):
            matcher.feed(event.text)
            if matcher.stopped:
                gen.handle.cancel()
        elif isinstance(event, Failed):
            return error_response(failure(event))
        elif isinstance(event, APIError):
            return error_response(event)
        elif isinstance(event, Finished):
            stopped(state, gen, matcher)
            text = matcher.text
            if endpoint == "chat":
                state.memory.remember(state.engine.tokenizer, text, event.token_ids)
            reason = _finish_reason(event.metrics, matcher)
            if endpoint == "chat":
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                }
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
                obj = "text_completion"
            n = returned_tokens(state.engine.tokenizer, event.token_ids, text, matcher.stopped)
            return JSONResponse(
                {**head, "object": obj, "choices": [choice], "usage": usage(event.metrics, n)}
            )
    return Response(status_code=499)  # the client went away


# ---------------------------------------------------------------- server-sent events


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def stream_reply(
    state: ServeState, gen: Generation, params: Sampling, endpoint: str, head: dict
) -> AsyncIterator[str]:
    """The reply as server-sent events: ``chat.completion.chunk`` (a first chunk with the
    role) or ``text_completion`` chunks, a last one with the finish reason, the usage
    chunk when ``stream_options.include_usage`` asks for it, then ``data: [DONE]``. A
    failure is an error event. A client's disconnect closes this generator, which
    cancels the request (:meth:`Generation.events`)."""
    chat = endpoint == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if params.include_usage else {}

    def chunk(text: str | None, reason: str | None = None, first: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return sse({**head, "object": obj, "choices": [choice], **extra})

    matcher = StopMatcher(params.stop)
    if chat:
        yield chunk(None, first=True)
    async for event in gen.events():
        if isinstance(event, TokenBatch):
            text = matcher.feed(event.text)
            if text:
                yield chunk(text)
            if matcher.stopped:
                gen.handle.cancel()
        elif isinstance(event, Failed):
            yield sse(failure(event).body())
        elif isinstance(event, APIError):
            yield sse(event.body())
        elif isinstance(event, Finished):
            stopped(state, gen, matcher)
            rest = matcher.flush()
            if rest:
                yield chunk(rest)
            if chat:
                state.memory.remember(state.engine.tokenizer, matcher.text, event.token_ids)
            yield chunk(None, _finish_reason(event.metrics, matcher))
            if params.include_usage:
                n = returned_tokens(
                    state.engine.tokenizer, event.token_ids, matcher.text, matcher.stopped
                )
                yield sse({**head, "object": obj, "choices": [], "usage": usage(event.metrics, n)})
    yield "data: [DONE]\n\n"
