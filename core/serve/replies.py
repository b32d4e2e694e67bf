"""What every adapter of ``tierchat serve`` sends back in common: OpenAI's error objects
and ``usage``, server-sent events, and a failure's status (docs/DESIGN.md §15).

``usage`` is OpenAI's (``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``prompt_tokens_details.cached_tokens``) plus ``usage.tierchat``: cached tokens by tier
(``cached_by``) and by entry kind (``cached_kind``), ``prefill_tokens``, ``ttft_s``,
``prefill_tps``, ``generation_tps``, ``ssd_write_bytes``. A reply the engine ended at a
``stop`` string counts only the tokens returned.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..api import Failed, TurnMetrics
from ..text import log_safe
from .prompts import APIError
from .state import SHUTDOWN_RETRY_AFTER_S

if TYPE_CHECKING:
    from .generation import ClientGone


# ---------------------------------------------------------------- errors


def error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(e.retry_after_s)
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


# a memory refusal that a later try may pass: the machine's free memory is short (other
# programs hold it) while this server holds no request to release any; requests that
# only wait for others held are queued, never refused (docs/DESIGN.md §11)
MEMORY_RETRY_AFTER_S = 10


def failure(event: Failed) -> APIError:
    if event.kind == "refused" and event.permanent:
        # larger than the memory limit alone: no retry helps, so no 503
        return APIError(event.message, 400, code="insufficient_memory")
    if event.kind == "refused":  # the memory guard: not the prompt's fault, try later
        return APIError(
            event.message,
            503,
            "server_error",
            code="insufficient_memory",
            retry_after_s=MEMORY_RETRY_AFTER_S,
        )
    if event.kind == "cancelled":
        return APIError(event.message, 499, "server_error", code="cancelled")
    return APIError(event.message, 500, "server_error", code=event.kind)


def internal_error() -> APIError:
    """A 500 that names nothing of the server's code (the traceback goes to its log)."""
    return APIError("internal server error (details in the server's log)", 500, "server_error")


def client_gone(http: Request, gone: ClientGone) -> Response:
    """A client that closed its connection before its request was queued: one line on
    stderr (a local client dropping many connections must not fill the log with
    tracebacks) and a 499 that nobody reads."""
    host = http.client.host if http.client else "?"
    when = str(gone) or "before its request was queued"
    print(
        f"client {log_safe(host)} closed its connection {when}: {http.method} {log_safe(http.url.path[:80])}",
        file=sys.stderr,
    )
    return Response(status_code=499)


def shutting_down() -> APIError:
    return APIError(
        "the server is shutting down",
        503,
        "server_error",
        code="server_shutting_down",
        retry_after_s=SHUTDOWN_RETRY_AFTER_S,
    )


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


# ---------------------------------------------------------------- server-sent events


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
