"""The HTTP server of ``tierchat serve``: uvicorn on a thread (:class:`ServerThread`),
with the connection guards uvicorn lacks (:func:`guarded_protocol`): a bound on open
connections (past it, a 503 with ``Retry-After``) and a timeout on a new connection's
headers (docs/DESIGN.md §15).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .limits import ServeLimits


def over_capacity(limits: ServeLimits):
    """The ASGI app that answers a request on a connection past
    ``limits.max_connections``: 503 ``too_many_connections`` with ``Retry-After`` and
    ``Connection: close``, in Anthropic's error shape under ``/v1/messages``, OpenAI's
    elsewhere. The body (at most ``limits.max_body_bytes``) is read first: closing a socket
    with unread bytes resets it, and the client would lose the answer."""
    from .anthropic_api import error_response as anthropic_error
    from .prompts import APIError
    from .replies import error_response

    async def app(scope, receive, send) -> None:
        size, more = 0, scope.get("method") not in ("GET", "HEAD")
        while more and size <= limits.max_body_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        error = APIError(
            f"the server has {limits.max_connections} connections open, its limit",
            503,
            "server_error",
            code="too_many_connections",
        )
        path = scope.get("path", "")
        anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
        response = anthropic_error(error) if anthropic else error_response(error)
        response.headers["Connection"] = "close"
        await response(scope, receive, send)

    return app


def guarded_protocol(limits: ServeLimits) -> type:
    """uvicorn's h11 protocol with the guards uvicorn lacks for a fresh connection.

    A connection past ``limits.max_connections`` is kept until its request's headers
    come, which then gets :func:`over_capacity`'s 503 (uvicorn's own ``limit_concurrency``
    answers a plain-text 503 without ``Retry-After``, and counts the connection itself, so
    it refuses at the limit rather than past it: it is not used). Past twice the limit a
    connection is closed at once, unanswered, so a flood cannot run the process out of
    file descriptors. A connection whose request headers are not complete within
    ``limits.header_timeout_s`` is closed then (a half-sent request must not hold a file
    descriptor for ever: docs/DESIGN.md §15)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    refuse = over_capacity(limits)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            open_now = len(self.connections)
            if open_now > 2 * limits.max_connections:
                transport.close()
                return
            if open_now > limits.max_connections:
                self.app = refuse  # this connection's requests: 503, then it closes
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

    Connections are bounded by ``limits`` (:func:`guarded_protocol`: requests on
    connections past ``max_connections`` get 503 with ``Retry-After``), headers by h11's
    16 KiB, idle
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
