"""The app behind ``tierchat serve``: an OpenAI-compatible HTTP endpoint on the one engine
and its cache (the command itself, its flags and its stop sequence: ``cli/serve.py``).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming with
server-sent events, or not), ``GET /v1/models``, ``GET /health``. Every generation is a
``GenerateRequest`` submitted to the one engine through a
:class:`~tierchat.core.serve.log.TrackedEngine`, so requests queue for the engine's thread
(its depth shows in ``/health``, the console and the log) and hit the same prefix cache as
``tierchat chat``. Prompts are built as the chat builds them (:mod:`tierchat.core.serve.prompts`);
replies, whole or streamed, and errors in OpenAI's shapes come from
:mod:`tierchat.core.serve.replies`. Binding to anything but loopback needs
``--allow-remote`` and an API key (``--api-key`` or ``TIERCHAT_API_KEY``), checked as
``Authorization: Bearer <key>``.

Every request is hostile until checked, before any work is queued (docs/DESIGN.md §15):
``Host``/``Origin`` and the key (:mod:`tierchat.core.serve.guard`), the media type, body
size, JSON numbers, message count, token ids and context
(:mod:`tierchat.core.serve.limits`); prompts are built on at most ``build_slots`` threads
and dropped when their client leaves (:mod:`tierchat.core.serve.generation`); connections
are bounded with a header timeout (:mod:`tierchat.core.serve.server`). SIGTERM and
SIGINT stop in order (:mod:`tierchat.cli.serve_shutdown`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..api import GenerateRequest
from ..chat.prompts import PromptBuilder
from ..text import log_safe
from .generation import ClientGone, Generation, off_loop
from .guard import HostGuard, authorize
from .limits import (
    ServeLimits,
    check_prompt,
    context_length,
    model_vocab,
    parse_body,
    vocab_size,
)
from .log import TrackedEngine
from .prompts import (
    APIError,
    ReplyMemory,
    build_chat_prompt,
    completion_prompt,
    sampling,
)
from .replies import (
    error_response,
    internal_error,
    shutting_down,
    stream_reply,
    whole_reply,
)

API_KEY_ENV = "TIERCHAT_API_KEY"
MAX_NEW_RENDERS = (
    64  # prefix renders per request: prompt building stays linear (docs/DESIGN.md §15)
)


class ServeState:
    """What the routes share: the tracked engine, the log, the reply memory, defaults."""

    def __init__(
        self,
        engine: TrackedEngine,
        *,
        api_key: str | None = None,
        max_tokens: int = 512,
        seed: int | None = None,
        use_cache: bool = True,
        max_queue: int = 64,
        memory_entries: int = 256,
        memory_path: str | os.PathLike | None = None,
        limits: ServeLimits | None = None,
        bind_host: str = "127.0.0.1",
        build_slots: int = 2,
    ) -> None:
        self.engine = engine
        self.limits = limits or ServeLimits()
        self.bind_host = bind_host
        self.build_slots = build_slots
        self._build_sem: asyncio.Semaphore | None = None
        self.draining = False  # a signal came: new requests get 503
        self.generations: set[Generation] = set()
        self.log = engine.log
        self.api_key = api_key
        self.max_tokens = max_tokens
        self.seed = seed
        self.use_cache = use_cache
        self.max_queue = max_queue
        self.memory = ReplyMemory(memory_entries, memory_path)
        self.created = int(time.time())
        self._builder: PromptBuilder | None = None

    def builder(self) -> PromptBuilder:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError("no model is loaded", 503, "server_error", code="model_not_loaded")
        if self._builder is None or self._builder.tokenizer is not tokenizer:
            self._builder = PromptBuilder(tokenizer, max_renders=MAX_NEW_RENDERS)
        return self._builder

    def build_semaphore(self) -> asyncio.Semaphore:
        """At most ``build_slots`` prompts are built at once (on threads), so many large
        requests cannot starve the event loop's threads or the engine's callers."""
        if self._build_sem is None:
            self._build_sem = asyncio.Semaphore(self.build_slots)
        return self._build_sem

    def abort_all(self, message: str) -> int:
        """End every open generation with a 503 ``server_shutting_down`` error (streams get
        it as an error event) and cancel it on the engine. Any thread. Returns how many."""
        error = APIError(message, 503, "server_error", code="server_shutting_down")
        gens = list(self.generations)
        for gen in gens:
            gen.abort(error)
        return len(gens)


# ---------------------------------------------------------------- one request


def reply_memory_path(settings: Any, model_name: str) -> Path:
    """Where the server keeps its reply memory for ``model_name``: one file per model
    under the data dir (``serve-replies/<sha256(model)[:16]>.jsonl``)."""
    digest = hashlib.sha256(model_name.encode()).hexdigest()[:16]
    return Path(settings.data_dir) / "serve-replies" / f"{digest}.jsonl"


def ranks_failure(engine: Any) -> str:
    """Why the ranks failed (a rank lost, or silent past ``--rank-timeout``), "" while
    they work or when there is one rank (docs/DESIGN.md §19)."""
    failed = getattr(getattr(engine, "peers", None), "failed", "")
    return failed if isinstance(failed, str) else ""


def client_label(request: Request, body: dict) -> str:
    """``host label``: the request's ``user`` field, else the User-Agent's product; control
    characters escaped (:func:`~tierchat.core.text.log_safe`), as it goes to logs."""
    host = request.client.host if request.client else "?"
    user = body.get("user")
    if isinstance(user, str) and user:
        return f"{host} {log_safe(user[:24])}"
    agent = request.headers.get("user-agent", "").split(" ")[0]
    return f"{host} {log_safe(agent[:24])}" if agent else host


async def read_body(http: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes. Raises :class:`APIError` 413 beyond it
    (by ``Content-Length`` before reading, or while reading a chunked body)."""
    too_big = APIError(
        f"the request body is larger than {limit} bytes", 413, code="request_too_large"
    )
    length = http.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise too_big
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _prepare(state: ServeState, http: Request, endpoint: str):
    """Check the key, the queue and the body; build the request and check its ids and
    length against the model. Raises :class:`APIError` (or :class:`ClientGone`)."""
    authorize(state, http)
    raw = await read_body(http, state.limits.max_body_bytes)
    body = parse_body(http.headers.get("content-type"), raw)
    params = sampling(body, state.max_tokens, state.seed)
    explicit = any(body.get(k) is not None for k in ("max_tokens", "max_completion_tokens"))
    builder = state.builder()
    if endpoint == "chat":
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > state.limits.max_messages:
            raise APIError(
                f"{len(messages)} messages is more than this server takes "
                f"({state.limits.max_messages})",
                param="messages",
                code="too_many_messages",
            )
        prompt = await off_loop(state, http, build_chat_prompt, builder, body, state.memory)
        ids, boundaries = prompt.prompt.token_ids, prompt.prompt.boundaries
    else:
        if body.get("echo"):
            raise APIError("echo is not supported", param="echo")
        if body.get("suffix"):
            raise APIError("suffix is not supported", param="suffix")
        ids = await off_loop(state, http, completion_prompt, builder.tokenizer, body)
        boundaries = ()
    max_tokens = check_prompt(
        ids,
        params.max_tokens,
        explicit=explicit,
        # a chat prompt holds ids of the tokenizer and ids the model generated (the reply
        # memory): only the model's own bound can judge the latter
        vocab=vocab_size(state.engine) if endpoint != "chat" else model_vocab(state.engine),
        context=context_length(state.engine),
        param="messages" if endpoint == "chat" else "prompt",
    )
    if await http.is_disconnected():  # gone while its prompt was built: queue nothing
        raise ClientGone
    waiting = state.engine.queue_depth
    if waiting >= state.max_queue:
        raise APIError(
            f"the engine queue is full ({waiting} requests)", 503, "server_error", code="queue_full"
        )
    request = GenerateRequest(
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p if params.top_p > 0 else 1.0,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed,
        boundaries=boundaries,
        use_cache=state.use_cache,
    )
    return body, params, request


async def generate(state: ServeState, http: Request, endpoint: str) -> Response:
    if state.draining:
        return error_response(shutting_down())
    try:
        body, params, request = await _prepare(state, http, endpoint)
    except APIError as e:
        return error_response(e)
    except ClientGone:
        return Response(status_code=499)
    except Exception:  # noqa: BLE001 -- a bug of ours: logged, a 500 without internals
        traceback.print_exc(file=sys.stderr)
        return error_response(internal_error())
    if state.draining:  # a signal came while the prompt was built
        return error_response(shutting_down())
    client = client_label(http, body)
    gen = Generation(state, request, client, endpoint)
    ident = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    head = {"id": ident, "created": int(time.time()), "model": state.engine.model_name}
    if params.stream:
        return StreamingResponse(
            stream_reply(state, gen, params, endpoint, head),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await whole_reply(state, gen, http, params, endpoint, head)


# ---------------------------------------------------------------- the app


def create_app(state: ServeState) -> Starlette:
    """The ASGI app over ``state`` (routes in the module docstring)."""

    async def chat_completions(http: Request) -> Response:
        return await generate(state, http, "chat")

    async def completions(http: Request) -> Response:
        return await generate(state, http, "completion")

    async def models(http: Request) -> Response:
        try:
            authorize(state, http)
        except APIError as e:
            return error_response(e)
        name = state.engine.model_name
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "tierchat"}]
        return JSONResponse({"object": "list", "data": data if name else []})

    async def health(http: Request) -> Response:
        snap = state.log.snapshot()
        failed = ranks_failure(state.engine)
        if failed:  # the process is going: exit code 1 after its stop sequence
            return JSONResponse(
                {"status": "failed", "error": failed, "model": state.engine.model_name},
                status_code=503,
            )
        wear = state.engine.stats().wear
        return JSONResponse(
            {
                "status": "ok" if state.engine.model_name else "loading",
                "model": state.engine.model_name,
                "queue": {"waiting": snap.waiting, "running": snap.running},
                "requests": snap.total,
                # SSD bytes written (docs/DESIGN.md §8.6)
                "ssd_writes": {
                    k: getattr(wear, k)
                    for k in ("session_bytes", "total_bytes", "day_bytes", "budget_bytes")
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
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error}
    )
    return HostGuard(app, state)
