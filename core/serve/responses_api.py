"""Placeholder while the adapter is written (branch serve-core only)."""

from starlette.requests import Request
from starlette.responses import Response

from .state import ServeState


async def _todo(state: ServeState, http: Request) -> Response:
    return Response(status_code=501)


messages = count_tokens = create = retrieve = _todo
