"""Store writes and prompt building off the UI loop (docs/DESIGN.md §16).

A conversation store call (SQLite) or a prompt render (the chat template and the
tokenizer) can take long enough to drop frames, so the chat screen runs them here: on one
thread, in the order they were asked for (a send's user message is stored before the
rename that follows it), each wrapped in a Textual thread worker so the app (and a test's
``app.workers.wait_for_complete()``) sees it running. No MLX here: the engine has its own
thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from textual.dom import DOMNode
from textual.worker import WorkerFailed

T = TypeVar("T")


class BackgroundWriter:
    """One thread for the store and the prompt builder, first in first out.

    :meth:`run` awaits one call's result on the UI loop without blocking it; the call's
    exception is raised there. :meth:`close` waits for the writes already asked for
    (nothing stored is lost at exit).
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierchat-store")

    async def run(self, node: DOMNode, call: Callable[[], T]) -> T:
        """Run ``call`` on the writer thread after every call asked for before it; returns
        its result, raises its exception. ``node`` owns the worker that waits for it."""
        future = self._pool.submit(call)
        worker = node.run_worker(
            future.result, thread=True, group="store", exit_on_error=False, exclusive=False
        )
        try:
            return await worker.wait()
        except WorkerFailed as e:
            raise e.error from None

    def close(self) -> None:
        """Finish the calls asked for, then stop the thread."""
        self._pool.shutdown(wait=True)
