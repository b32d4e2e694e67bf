"""The app behind ``tierchat serve``: OpenAI-, Anthropic- and Responses-compatible HTTP
endpoints on the one engine and its cache (the command itself, its flags and its stop
sequence: ``cli/serve.py``).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``
(:mod:`tierchat.core.serve.openai_api`), ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (:mod:`tierchat.core.serve.anthropic_api`),
``POST /v1/responses`` and ``GET /v1/responses/{id}``
(:mod:`tierchat.core.serve.responses_api`), ``GET /v1/models``, ``GET /health``. Each API
is a thin adapter: its body becomes the one internal request
(:mod:`tierchat.core.serve.request`: prompt building with the chat's builder, tools,
checks), the engine's events become the reply's parts (:mod:`tierchat.core.serve.reply`:
stop strings, reasoning, tool calls parsed with mlx-lm's per-family parsers), which the
adapter writes in its own wire format. Every generation is a ``GenerateRequest`` submitted
to the one engine through a :class:`~tierchat.core.serve.log.TrackedEngine`, so requests
queue for the engine's thread and hit the same prefix cache as ``tierchat chat``. Binding
to anything but loopback needs ``--allow-remote`` and an API key (``--api-key`` or
``TIERCHAT_API_KEY``), checked as ``Authorization: Bearer <key>`` or ``x-api-key``.

Every request is hostile until checked, before any work is queued (docs/DESIGN.md §15):
``Host``/``Origin`` and the key (:mod:`tierchat.core.serve.guard`), the media type, body
size, JSON numbers, message count, token ids and context
(:mod:`tierchat.core.serve.limits`); prompts are built on at most ``build_slots`` threads
and dropped when their client leaves (:mod:`tierchat.core.serve.generation`); connections
are bounded with a header timeout (:mod:`tierchat.core.serve.server`). SIGTERM and
SIGINT stop in order (:mod:`tierchat.cli.serve_shutdown`).
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import anthropic_api, openai_api, responses_api
from .guard import HostGuard, authorize
from .limits import context_length
from .prompts import APIError
from .replies import error_response, internal_error
from .state import SHUTDOWN_RETRY_AFTER_S, ServeState, ranks_failure

# ---------------------------------------------------------------- the app


def create_app(state: ServeState) -> Starlette:
    """The ASGI app over ``state`` (routes in the module docstring)."""

    def route(fn):
        async def endpoint(http: Request) -> Response:
            return await fn(state, http)

        return endpoint

    async def models(http: Request) -> Response:
        try:
            authorize(state, http)
        except APIError as e:
            return error_response(e)
        name = state.engine.model_name
        context = context_length(state.engine)
        model = {"id": name, "object": "model", "created": state.created, "owned_by": "tierchat"}
        if context is not None:  # clients size their compaction from it
            model |= {"context_length": context, "max_model_len": context}
        data = [model]
        return JSONResponse({"object": "list", "data": data if name else []})

    async def health(http: Request) -> Response:
        snap = state.log.snapshot()
        failed = ranks_failure(state.engine)
        if failed:  # the process is going: exit code 1 after its stop sequence
            return JSONResponse(
                {"status": "failed", "error": failed, "model": state.engine.model_name},
                status_code=503,
                headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)},
            )
        stats = state.engine.stats()
        wear, mem = stats.wear, stats.memory
        return JSONResponse(
            {
                "status": "ok" if state.engine.model_name else "loading",
                "model": state.engine.model_name,
                "queue": {"waiting": snap.waiting, "running": snap.running},
                "requests": snap.total,
                # SSD bytes written (docs/DESIGN.md §8.6)
                "ssd_writes": {
                    k: getattr(wear, k)
                    for k in (
                        *("session_bytes", "total_bytes", "day_bytes", "budget_bytes"),
                        # what a crash would lose now (docs/DESIGN.md §8.6)
                        *("pending_bytes", "deferred", "deferred_bytes"),
                    )
                },
                # MLX's allocator (docs/DESIGN.md §11); peak: since the last prefill began;
                # committed: weights + what the requests held reserve + the cache tiers
                "memory": {
                    "active_bytes": mem.active,
                    "peak_bytes": mem.peak,
                    "process_peak_bytes": mem.process_peak,
                    "committed_bytes": mem.committed,
                    "waiting": mem.waiting,  # requests queued until memory frees
                    "waited": mem.waited,  # heads of the queue that waited, since the load
                    "limit_bytes": mem.limit,
                    "level": mem.level,
                },
            }
        )

    async def http_error(http: Request, exc: HTTPException) -> Response:
        code = "unknown_url" if exc.status_code == 404 else None
        text = f"{http.method} {http.url.path}: {exc.detail}"
        return error_response(APIError(text, exc.status_code, code=code))

    async def server_error(http: Request, exc: Exception) -> Response:
        return error_response(internal_error())

    routes = [
        Route("/v1/chat/completions", route(openai_api.chat_completions), methods=["POST"]),
        Route("/v1/completions", route(openai_api.completions), methods=["POST"]),
        Route("/v1/messages", route(anthropic_api.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", route(anthropic_api.count_tokens), methods=["POST"]),
        Route("/v1/responses", route(responses_api.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", route(responses_api.retrieve), methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error}
    )
    return HostGuard(app, state)
