"""The SSD tier's writer: the queue of entries accepted and not yet on disk, the one
thread that writes them, backpressure, holds and flush (docs/DESIGN.md §8.4).

An entry is *pending* from the moment the tier accepts it until its file is renamed into
place (or it is dropped). The tier's index and the pending entries are guarded by one
lock, the tier's, which the writer shares as a :class:`threading.Condition`: an entry
leaves both at once, so a lookup never sees one without the other.

- **Backpressure.** When ``queue_size`` entries or ``max_pending_bytes`` wait, the engine
  thread blocks in :meth:`SSDWriter.wait_for_room` until the writer catches up, at most
  ``backpressure_timeout_s``: what a lookup sees is a function of the calls made, not of
  the writer's progress.
- **Holds.** :meth:`SSDWriter.pause` holds the writer (and the start-up verifier, between
  files) until every holder resumes; backpressure and :meth:`SSDWriter.flush` let it run
  anyway until its queue empties.
- **Writes.** A file is written to ``<id>.<pid>.<n>.tmp`` (0600, ``O_EXCL``, no
  symbolic link followed), its data piece by piece (each at most ``io.PIECE_BYTES``,
  checksummed as it goes, the sealed header written last at offset 0), and renamed into
  place only while its entry is still pending;
  the tier decides what a failed write costs (``on_failed``: a full disk shrinks its cap).

The writer thread handles numpy views and bytes only and never builds an MLX graph.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..blocks import Entry
from ..wear import WriteLedger
from .format import seal_header
from .io import _raw_bytes


@dataclass(eq=False)
class Pending:
    """An entry accepted by the tier and not yet on disk."""

    entry: Entry  # the arrays as given (what a load returns meanwhile)
    head: bytes  # encode_header(...), CRCs not yet filled
    nbytes: int  # the file's size
    # the tensor bytes in order, each piece at most io.PIECE_BYTES (:func:`.io.copy_pieces`)
    pieces: list[mx.array] | None = None


def _write_all(f, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view) :]


class SSDWriter:
    """One writer thread over a queue of :class:`Pending` entries.

    ``cond``: the tier's condition (its lock guards the index and ``pending`` together).
    ``path_of(id)``: where an entry's file goes; ``prepare_dir(path)``: called before each
    write, makes the file's directory exist (raises OSError when it cannot);
    ``on_failed(item, exc)``: called with the lock held after a failed write, returns the
    event's text; ``on_idle()``: called each time the queue empties; ``on_event(text)``:
    the tier's log. ``ledger`` records every file written.

    Test hooks: ``write_delay_s`` (every write sleeps this long first) and
    ``write_jitter_s`` (plus a random ``[0, write_jitter_s)``), as instance or class
    attributes.
    """

    write_delay_s: float = 0.0
    write_jitter_s: float = 0.0
    backpressure_timeout_s: float = 120.0

    def __init__(
        self,
        cond: threading.Condition,
        *,
        path_of: Callable[[str], Path],
        prepare_dir: Callable[[Path], None],
        on_failed: Callable[[Pending, Exception], str],
        on_idle: Callable[[], None],
        on_event: Callable[[str], None],
        ledger: WriteLedger,
        queue_size: int = 64,
        max_pending_bytes: int = 1 << 30,
    ) -> None:
        self._cond = cond
        self._path_of = path_of
        self._prepare_dir = prepare_dir
        self._on_failed = on_failed
        self._on_idle = on_idle
        self._on_event = on_event
        self.ledger = ledger
        self.queue_size = max(1, queue_size)
        self.max_pending_bytes = max_pending_bytes
        self.pending: dict[str, Pending] = {}  # by entry id
        self.pending_bytes = 0
        self._queue: list[Pending | None] = []
        # who holds the writer now (requests before their first token, the engine while
        # it decodes: :meth:`pause`); ``_force`` lets it run anyway until its queue empties
        self._holds: set[Any] = set()
        self._force = False
        self._flushing = 0  # flush() calls waiting: no hold applies meanwhile
        self._stopped = False
        self._tmp_seq = itertools.count()
        self.saves_queued = self.saves_persisted = 0
        self.bytes_queued = 0  # bytes of the files accepted for writing
        self.backpressure_waits = 0
        self.backpressure_s = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tierchat-ssd-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Drop every hold, end the thread after what is queued, wait ``timeout_s`` for it."""
        with self._cond:
            self._holds.clear()
            self._stopped = True
            self._queue.append(None)
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    # ------------------------------------------------------------------ the queue
    # (the caller holds the lock)

    def wait_for_room(self, size: int) -> bool:
        """Backpressure on the engine thread: wait while the queue is full for an entry of
        ``size`` bytes (a hold gives way meanwhile); False after ``backpressure_timeout_s``."""

        def full() -> bool:
            return bool(self.pending) and (
                len(self.pending) >= self.queue_size
                or self.pending_bytes + size > self.max_pending_bytes
            )

        if not full():
            return True
        if self._holds and not self._force:  # backpressure wins over a hold
            self._force = True
            self._cond.notify_all()
        self.backpressure_waits += 1
        t0 = time.monotonic()
        ok = self._cond.wait_for(lambda: not full(), self.backpressure_timeout_s)
        self.backpressure_s += time.monotonic() - t0
        return ok

    def enqueue(self, item: Pending) -> None:
        """Queue ``item`` for writing (it is pending from now)."""
        self.pending[item.entry.id] = item
        self.pending_bytes += item.nbytes
        self.saves_queued += 1
        self.bytes_queued += item.nbytes
        self._queue.append(item)
        self._cond.notify_all()

    def abandon(self, entry_id: str) -> bool:
        """Forget the pending write of ``entry_id`` (its file is then never renamed into
        place); False when it has none."""
        item = self.pending.pop(entry_id, None)
        if item is None:
            return False
        self.pending_bytes -= item.nbytes
        self._cond.notify_all()
        return True

    # ------------------------------------------------------------------ holds and flush

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every pending entry is on disk (or dropped), holds set aside; False
        on timeout."""
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: not self.pending, timeout)
            finally:
                self._flushing -= 1

    def pause(self, holder: Any = None) -> None:
        """Hold the writer and the start-up verifier (between files) until every holder
        has called :meth:`resume`. ``holder``: any hashable key (None: one shared key)."""
        with self._cond:
            self._holds.add(holder)

    def resume(self, holder: Any = None) -> None:
        """Give up ``holder``'s hold (no effect if it holds none)."""
        with self._cond:
            self._holds.discard(holder)
            self._cond.notify_all()

    @property
    def held(self) -> bool:
        """Whether a holder keeps the writer waiting now (and no flush or backpressure
        overrides it)."""
        with self._cond:
            return self._held()

    def _held(self) -> bool:
        return bool(self._holds) and not self._force and not self._flushing

    def wait_unheld(self) -> bool:
        """Block while a holder keeps disk work waiting; False once the writer stops."""
        with self._cond:
            self._cond.wait_for(lambda: not self._held() or self._stopped)
        return not self._stopped

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        rng = random.Random()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue and not self._held())
                item = self._queue.pop(0)
            if item is None:
                return
            delay = self.write_delay_s + rng.uniform(0, self.write_jitter_s)
            if delay > 0:
                time.sleep(delay)
            try:
                self._write(item)
            except Exception as exc:  # never let the writer die: count and go on
                with self._cond:
                    text = self._on_failed(item, exc)
                self._on_event(text)
            finally:
                item.pieces = None  # the copy goes once written (or dropped)
            with self._cond:
                idle = not self._queue
                if idle:
                    self._force = False
            if idle:
                self._on_idle()

    def _write(self, item: Pending) -> None:
        """Write one file and rename it into place if its entry is still pending. An
        ``OSError`` is handled here (``on_failed``); anything else reaches :meth:`_loop`."""
        eid = item.entry.id
        with self._cond:
            if self.pending.get(eid) is not item:
                return  # evicted, removed or replaced since
        path = self._path_of(eid)
        tmp = path.with_name(f"{eid}.{os.getpid()}.{next(self._tmp_seq)}.tmp")
        try:
            self._prepare_dir(path)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(tmp, flags, 0o600)
            with open(fd, "wb", buffering=0) as f:
                _write_all(f, item.head)  # CRCs zeroed: sealed once the data is out
                crc = 0
                for piece in item.pieces or ():
                    data = _raw_bytes(piece)
                    crc = zlib.crc32(data, crc)
                    _write_all(f, memoryview(data))
                if os.pwrite(fd, seal_header(item.head, crc), 0) != len(item.head):
                    raise OSError(f"short header write to {tmp.name}")
            with self._cond:
                if self.pending.get(eid) is item:
                    os.replace(tmp, path)
                    del self.pending[eid]
                    self.pending_bytes -= item.nbytes
                    self.saves_persisted += 1
                    self.ledger.record(item.nbytes)
                    self._cond.notify_all()
                    return
            tmp.unlink(missing_ok=True)  # dropped while written
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            with self._cond:
                text = self._on_failed(item, exc)
            self._on_event(text)
