"""One request's life against its client: its events from the engine, read on the event
loop, and the client's disconnect, which drops its work wherever it is (docs/DESIGN.md §15,
§20). A prompt being built on a thread is dropped (:func:`off_loop`); a queued or running
generation is cancelled, so the engine drops it at its next step (:class:`Generation`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from ..api import Event, Failed, Finished, GenerateRequest
from .prompts import APIError

if TYPE_CHECKING:
    from .state import ServeState

DISCONNECT_POLL_S = 0.5


class KeepAlive:
    """No event for ``keepalive_s``: a stream sends its keep-alive (an SSE comment, an
    Anthropic ``ping``), so a client's read timeout does not end a long prefill."""


class ClientGone(Exception):
    """The client closed its connection before its request was queued; ``str(e)`` says
    when ("while sending its body", "while its prompt was built")."""


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

    async def events(
        self, http: Request | None = None, keepalive_s: float | None = None
    ) -> AsyncIterator[Event | APIError | KeepAlive]:
        """The engine's events up to a terminal one. With ``http`` (a response sent at the
        end), a watcher cancels the request the moment the client disconnects, so the
        engine drops it at its next step (docs/DESIGN.md §20); a streaming response's
        disconnect cancels through Starlette closing this generator. With
        ``keepalive_s``, a :class:`KeepAlive` comes after each such wait without an event."""
        watcher = asyncio.ensure_future(self._watch(http)) if http is not None else None
        try:
            while True:
                if http is None:
                    try:
                        event = await asyncio.wait_for(self.queue.get(), keepalive_s)
                    except TimeoutError:
                        yield KeepAlive()
                        continue
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
                raise ClientGone("while its prompt waited to be built") from None
    task = asyncio.ensure_future(run_in_threadpool(fn, *args))
    task.add_done_callback(lambda _: sem.release())
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await http.is_disconnected():
            raise ClientGone("while its prompt was built")
