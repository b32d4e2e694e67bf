"""The server behind ``tierchat serve``: an OpenAI-compatible HTTP endpoint on the one engine
and its cache (the command itself, its flags and its stop sequence: ``cli/serve.py``).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming with
server-sent events, or not), ``GET /v1/models``, ``GET /health``. Every generation is a
``GenerateRequest`` submitted to the one engine through a
:class:`~tierchat.core.serve.log.TrackedEngine`, so requests queue for the engine's thread
(its depth shows in ``/health``, the console and the log) and hit the same prefix cache as
``tierchat chat``. Prompts are built as the chat builds them (:mod:`tierchat.core.serve.prompts`).

``usage`` is OpenAI's (``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``prompt_tokens_details.cached_tokens``) plus ``usage.tierchat``: cached tokens by tier
(``cached_by``) and by entry kind (``cached_kind``), ``prefill_tokens``, ``ttft_s``,
``prefill_tps``, ``generation_tps``. Errors are OpenAI's ``{"error": {...}}`` with its status
codes. Binding to anything but loopback needs ``--allow-remote`` and an API key
(``--api-key`` or ``TIERCHAT_API_KEY``), checked as ``Authorization: Bearer <key>``.

Every request is hostile until checked, before any work is queued (docs/DESIGN.md §15):
``Host``/``Origin`` (:class:`HostGuard`), the media type, body size, JSON numbers, message
count, token ids and context (:mod:`tierchat.core.serve.limits`); prompts are built on at
most ``build_slots`` threads (:func:`off_loop`) and dropped when their client leaves;
connections are bounded with a header timeout (:func:`guarded_protocol`). SIGTERM and
SIGINT stop in order (:mod:`tierchat.cli.serve_shutdown`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import os
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..api import Event, Failed, Finished, GenerateRequest, TokenBatch, TurnMetrics
from ..chat.prompts import PromptBuilder
from .limits import (
    ServeLimits,
    check_host,
    check_origin,
    check_prompt,
    context_length,
    model_vocab,
    parse_body,
    vocab_size,
)
from .log import TrackedEngine, log_safe
from .prompts import (
    APIError,
    ReplyMemory,
    Sampling,
    StopMatcher,
    build_chat_prompt,
    completion_prompt,
    returned_tokens,
    sampling,
)

API_KEY_ENV = "TIERCHAT_API_KEY"
DISCONNECT_POLL_S = 0.5
MAX_NEW_RENDERS = (
    64  # prefix renders per request: prompt building stays linear (docs/DESIGN.md §15)
)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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


# ---------------------------------------------------------------- responses


def reply_memory_path(settings: Any, model_name: str) -> Path:
    """Where the server keeps its reply memory for ``model_name``: one file per model
    under the data dir (``serve-replies/<sha256(model)[:16]>.jsonl``)."""
    digest = hashlib.sha256(model_name.encode()).hexdigest()[:16]
    return Path(settings.data_dir) / "serve-replies" / f"{digest}.jsonl"


def error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(e.retry_after_s)
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


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


def failure(event: Failed) -> APIError:
    if event.kind == "refused":  # the memory guard: not the prompt's fault, try later
        return APIError(
            event.message, 503, "server_error", code="insufficient_memory", retry_after_s=30
        )
    if event.kind == "cancelled":
        return APIError(event.message, 499, "server_error", code="cancelled")
    return APIError(event.message, 500, "server_error", code=event.kind)


def ranks_failure(engine: Any) -> str:
    """Why the ranks failed (a rank lost, or silent past ``--rank-timeout``), "" while
    they work or when there is one rank (docs/DESIGN.md §19)."""
    failed = getattr(getattr(engine, "ranks", None), "failed", "")
    return failed if isinstance(failed, str) else ""


def internal_error() -> APIError:
    """A 500 that names nothing of the server's code (the traceback goes to its log)."""
    return APIError("internal server error (details in the server's log)", 500, "server_error")


def shutting_down() -> APIError:
    return APIError("the server is shutting down", 503, "server_error", code="server_shutting_down")


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def client_label(request: Request, body: dict) -> str:
    """``host label``: the request's ``user`` field, else the User-Agent's product; control
    characters escaped (:func:`~tierchat.core.serve.log.log_safe`), as it goes to logs."""
    host = request.client.host if request.client else "?"
    user = body.get("user")
    if isinstance(user, str) and user:
        return f"{host} {log_safe(user[:24])}"
    agent = request.headers.get("user-agent", "").split(" ")[0]
    return f"{host} {log_safe(agent[:24])}" if agent else host


# ---------------------------------------------------------------- one generation


class Generation:
    """One request to the engine, read as async events; cancels it if abandoned. Listed
    in ``state.generations`` while open, so a shutdown can end it (:meth:`abort`)."""

    def __init__(self, state: ServeState, request: GenerateRequest, client: str, endpoint: str):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event | APIError] = asyncio.Queue()
        self.state = state
        self.handle = state.engine.submit(request, self._post, client=client, endpoint=endpoint)
        state.generations.add(self)

    def _post(self, event: Event | APIError) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is gone (server stopped)
            self.handle.cancel()

    def abort(self, error: APIError) -> None:
        """End the events with ``error`` (any thread) and cancel the engine's work."""
        self._post(error)
        self.handle.cancel()

    async def events(self, http: Request | None = None) -> AsyncIterator[Event | APIError]:
        """The engine's events up to a terminal one. With ``http`` (a response sent at the
        end), a watcher cancels the request the moment the client disconnects, so the
        engine drops it at its next step (docs/DESIGN.md §20); a streaming response's
        disconnect cancels through Starlette closing this generator."""
        watcher = asyncio.ensure_future(self._watch(http)) if http is not None else None
        try:
            while True:
                if http is None:
                    event = await self.queue.get()
                else:
                    try:
                        event = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                    except TimeoutError:
                        if await http.is_disconnected():
                            return
                        continue
                yield event
                if isinstance(event, Finished | Failed | APIError):
                    return
        finally:
            if watcher is not None:
                watcher.cancel()
            self.state.generations.discard(self)
            if not self.handle.done:
                self.handle.cancel()

    async def _watch(self, http: Request) -> None:
        """Wait for the client's disconnect (its body is read: the next ASGI message is
        ``http.disconnect``) and cancel the request then."""
        while not self.handle.done:
            message = await http.receive()
            if message.get("type") == "http.disconnect":
                self.handle.cancel()
                return


class ClientGone(Exception):
    """The client closed its connection before its request was queued."""


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


async def off_loop(state: ServeState, http: Request, fn, *args):
    """``fn(*args)`` on a worker thread, at most ``state.build_slots`` at once; raises
    :class:`ClientGone` if the client leaves while it waits or runs (a running build
    finishes on its thread, holding its slot; its result is dropped)."""
    sem = state.build_semaphore()
    while True:
        try:
            await asyncio.wait_for(sem.acquire(), DISCONNECT_POLL_S)
            break
        except TimeoutError:
            if await http.is_disconnected():
                raise ClientGone from None
    task = asyncio.ensure_future(run_in_threadpool(fn, *args))
    task.add_done_callback(lambda _: sem.release())
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await http.is_disconnected():
            raise ClientGone


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


def authorize(state: ServeState, http: Request) -> None:
    if not state.api_key:
        return
    scheme, _, key = http.headers.get("authorization", "").partition(" ")
    given = key.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, state.api_key.encode()):
        raise APIError(
            "missing or invalid API key (Authorization: Bearer <key>)",
            401,
            "authentication_error",
            code="invalid_api_key",
        )


def stopped(state: ServeState, gen: Generation, matcher: StopMatcher) -> None:
    """A reply cut at a stop string was cancelled on the engine; the log shows it done."""
    seq = getattr(gen.handle, "log_seq", None)
    if matcher.stopped and seq is not None:
        state.log.update(seq, status="done", metrics_changes={"finish_reason": "stop"})


def _finish_reason(metrics: TurnMetrics, matcher: StopMatcher) -> str:
    if matcher.stopped:
        return "stop"
    return "length" if metrics.finish_reason == "length" else "stop"


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
            _stream(state, gen, params, endpoint, head),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
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


async def _stream(
    state: ServeState, gen: Generation, params: Sampling, endpoint: str, head: dict
) -> AsyncIterator[str]:
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


class HostGuard:
    """ASGI middleware: every HTTP request's ``Origin`` header, and its ``Host`` header
    when the server asks for no key, are checked (:func:`~tierchat.core.serve.limits
    check_origin`, ``check_host``) before a route runs, so neither a web page nor a
    DNS-rebound name can drive or read the server. A server with a key (any non-loopback
    bind has one) is reached under whatever name its clients use: a rebound page cannot
    send the key."""

    def __init__(self, app: Any, state: ServeState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = {}
            for k, v in scope.get("headers", ()):
                headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
            try:
                if not self.state.api_key:
                    check_host(headers.get("host"), self.state.bind_host, self.state.limits)
                check_origin(headers.get("origin"), self.state.limits)
            except APIError as e:
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def guarded_protocol(limits: ServeLimits) -> type:
    """uvicorn's h11 protocol with two guards uvicorn lacks for a fresh connection: a
    connection beyond ``limits.max_connections`` is closed at once, and one whose request
    headers are not complete within ``limits.header_timeout_s`` is closed then (a
    half-sent request must not hold a file descriptor for ever: docs/DESIGN.md §15)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.close()
                return
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._header_timeout)

        def _header_timeout(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    return GuardedH11Protocol


class ServerThread:
    """uvicorn serving ``app`` on a thread (port 0: a free port); ``start`` waits until it
    listens, ``stop`` until it is gone. ``url`` is ``http://host:port``.

    Connections are bounded by ``limits`` (:func:`guarded_protocol`, uvicorn's
    ``limit_concurrency``: requests beyond it get 503), headers by h11's 16 KiB, idle
    keep-alive connections close after 5 s, and a stop waits at most
    ``graceful_s`` for open responses."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ServeLimits | None = None,
        graceful_s: float = 5.0,
    ) -> None:
        import uvicorn

        limits = limits or ServeLimits()
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            http=guarded_protocol(limits),
            limit_concurrency=limits.max_connections,
            timeout_keep_alive=5,
            h11_max_incomplete_event_size=16 * 1024,
            timeout_graceful_shutdown=max(1, int(graceful_s)),
        )
        self.server = uvicorn.Server(config)
        self.host = host
        self.port = port
        self.thread = threading.Thread(target=self.server.run, name="tierchat-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        sockets = [s for server in self.server.servers for s in server.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- the command
