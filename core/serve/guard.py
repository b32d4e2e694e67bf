"""The request guards of ``tierchat serve`` that run before any route: the ``Host`` and
``Origin`` headers (:class:`HostGuard`) and the API key (:func:`authorize`). What a
header may say is decided in :mod:`tierchat.core.serve.limits` (docs/DESIGN.md §15).
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from .limits import check_host, check_origin
from .prompts import APIError
from .replies import error_response

if TYPE_CHECKING:
    from .state import ServeState


def authorize(state: ServeState, http: Request) -> None:
    """Nothing when the server has no key; else ``Authorization: Bearer <key>`` or
    ``x-api-key: <key>`` (Anthropic's clients) must carry it (compared in constant time).
    Raises :class:`APIError` 401 ``invalid_api_key``."""
    if not state.api_key:
        return
    scheme, _, key = http.headers.get("authorization", "").partition(" ")
    given = [key.strip()] if scheme.lower() == "bearer" else []
    if "x-api-key" in http.headers:
        given.append(http.headers["x-api-key"].strip())
    want = state.api_key.encode()
    if not any(hmac.compare_digest(g.encode("utf-8", "surrogateescape"), want) for g in given):
        raise APIError(
            "missing or invalid API key (Authorization: Bearer <key>, or x-api-key)",
            401,
            "authentication_error",
            code="invalid_api_key",
        )


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
