"""How ``tierchat serve`` stops on SIGTERM or SIGINT (docs/DESIGN.md §15).

uvicorn runs on a thread (:class:`~tierchat.core.serve.server.ServerThread`), so its own signal
handlers are never installed (it installs them only on the main thread); these are.

The first signal: new requests get 503 ``server_shutting_down``; every open generation
ends with that error (a stream gets it as an error event, then ``[DONE]``) and is
cancelled on the engine; uvicorn stops listening and waits for the responses a few
seconds; the SSD writer gets ``bound_s`` seconds to write what is queued, and what it did
not write is dropped and reported; the engine closes; the command exits 0. A second
signal exits at once (``os._exit``: no interpreter teardown under the engine's MLX
thread, so no C++ abort), keeping every file already renamed into place.

When the ranks fail (a rank lost, or silent past ``--rank-timeout``), no request can run
again: :meth:`Shutdown.fail` starts the same sequence (``/health`` answers 503 "failed"
meanwhile), without closing the engine, whose thread may be blocked in a collective, and
the command exits 1 (``cli/ranks.py`` ends the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from tierchat.core.units import fmt_bytes

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Shutdown:
    """The stop sequence of one server: :meth:`signals` installs the handlers around the
    serving loop, which waits on ``requested``; :meth:`run` stops everything in order.
    ``on_request`` is called from the handler (the console uses it to quit its UI)."""

    def __init__(
        self,
        state: Any,
        server: Any,
        engine: Any,
        bound_s: float = 10.0,
        err: Any = None,
        on_request: Callable[[], None] | None = None,
    ) -> None:
        self.state = state
        self.server = server
        self.engine = engine
        self.bound_s = bound_s
        self.err = err or sys.stderr
        self.on_request = on_request
        self.requested = threading.Event()
        self.signal_name = ""
        self.failure = ""  # why the server stops on its own (the ranks failed)

    def say(self, text: str) -> None:
        print(f"tierchat serve: {text}", file=self.err, flush=True)

    def _handler(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested.is_set():
            self.say(f"second {name}: exiting now, queued SSD writes are dropped")
            os._exit(128 + signum)
        self.signal_name = name
        self.state.draining = True
        self.requested.set()
        if self.on_request is not None:
            self.on_request()

    def fail(self, why: str) -> None:
        """Stop because the server cannot serve any more (``why``): new requests get
        503, then :meth:`run` stops everything but the engine."""
        if self.requested.is_set():
            return
        self.failure = why
        self.state.draining = True
        self.requested.set()
        if self.on_request is not None:
            self.on_request()

    @contextlib.contextmanager
    def signals(self) -> Iterator[Shutdown]:
        """Install the SIGTERM/SIGINT handlers (main thread only) for the ``with`` body."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {s: signal.signal(s, self._handler) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def run(self) -> dict[str, int]:
        """Stop: refuse new requests, end open streams, stop uvicorn, write the SSD queue
        within ``bound_s``, close the engine. Returns ``{"streams", "written",
        "dropped"}`` (streams ended, SSD entries written and dropped during the stop)."""
        why = self.signal_name or ("the ranks failed" if self.failure else "stop")
        self.say(f"{why}: stopping (new requests get 503; open streams end with an error)")
        self.state.draining = True
        streams = self.state.abort_all(f"the server is shutting down ({why})")
        self.server.stop(timeout_s=10.0)
        queued = self.engine.writes_queued
        if queued:
            self.say(f"writing {queued} queued SSD entries (at most {self.bound_s:g} s)")
        # a failed engine's thread may be stuck in a collective: its queue is written,
        # the engine is left as it is
        flushed = self.engine.shutdown(self.bound_s, close=not self.failure)
        written, dropped = flushed.written, flushed.dropped
        tail = f"; {dropped} SSD entries not saved" if dropped else ""
        self.say(f"stopped ({streams} open requests ended, {written} SSD entries written{tail})")
        ssd = self.engine.stats().ssd
        if ssd.max_bytes:  # what a restart finds
            self.say(
                f"SSD tier: {ssd.entries} entries, {fmt_bytes(ssd.nbytes)} of "
                f"{fmt_bytes(ssd.max_bytes)} ({ssd.evictions} evicted under the cap, "
                f"{ssd.write_drops} writes dropped, {ssd.errors} errors)"
            )
        return {"streams": streams, "written": written, "dropped": dropped}


def quit_ui_later(app: Any) -> Callable[[], None]:
    """A handler hook that asks a Textual app running on this (the main) thread's event
    loop to exit, safely from a signal handler (``call_soon_threadsafe``)."""

    def request() -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_soon_threadsafe(app.exit)

    return request
