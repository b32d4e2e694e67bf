"""The SSD tier: one safetensors file per entry, under a byte cap, LRU by last access.

Layout: ``<cache_dir>/<fingerprint[:16]>/<id[:2]>/<id>.safetensors``, directories 0700 and
files 0600. The file format is :mod:`.format`'s (``tierchat-kv/2``, checksummed
safetensors); files are read by :mod:`.io`, written by :mod:`.writer`'s thread, and
checked at start by :mod:`.verifier` (the index rebuilt from headers, then every file read
once in the background), loaded by :mod:`.reader` (both CRCs checked again). A checksum or
format failure makes an entry *corrupt*: counted, logged with the reason, removed when
possible, never loaded; a resource error is a miss, the file kept (docs/DESIGN.md §8.4). A
file found missing leaves the index (someone removed it); so do files removed behind the
tier's back that nothing reads: :meth:`SSDTier.reconcile` (called where stats are taken) lists the folder
at most every :data:`RECONCILE_EVERY_S` seconds and forgets the written entries whose
files are gone, so ``entries`` and ``nbytes`` follow the disk without reading a file.

One process owns a cache dir (docs/DESIGN.md §8.4): the tier takes an exclusive
``fcntl.flock`` on ``<cache_dir>/lock`` (:func:`acquire_dir`; shared by the engines of one
process, released by the last ``close``) and turns itself off, saying who holds it, when
another process does. A cache dir removed while running is recreated at the next write,
and index rows whose files went with it are forgotten. A full disk shrinks the cap to
what is on disk and writes are retried after :data:`RETRY_AFTER_S`; every such change is
an event (``on_event``) and sets ``reason`` while it lasts.

Determinism: an entry is in the index (``meta``, ``children_of``, ``in``) from the moment
``put`` accepts it; until the writer has moved it to disk, ``load`` returns its arrays from
memory (the same dtype, shape and bits a load from disk gives). The byte cap and LRU
eviction are applied in ``put``, on the engine thread. When the writer falls behind,
``put`` blocks the engine thread until it catches up (backpressure, :mod:`.writer`)
instead of dropping: so what a lookup sees is a function of the calls made, not of the
writer's progress. Only a disk error (ENOSPC, EIO...) or a writer stuck for
``backpressure_timeout_s`` loses an entry, counted.

Threads: the engine thread calls ``put`` (already evaluated arrays), ``load`` and the
queries; the writer and verifier threads handle numpy views and bytes only and never build
an MLX graph; the reader threads of a restore fill staging arrays (:mod:`.reader`). The
index and the writer's pending entries are guarded by one lock.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from ...files import private_dirs
from ..blocks import Entry
from ..blocks import root_id as _root_id
from ..dir_lock import LOCK_FILE, CacheDirBusy, acquire_dir, release_dir, relock_dir
from ..wear import WriteLedger
from .format import FileMeta, entry_header
from .index import EntryIndex
from .io import _real_dir, copy_pieces, writable_dir
from .model_file import write_model_file
from .reader import SSDReader
from .verifier import StartupVerifier, entry_file_names, scan_entries
from .writer import Pending, SSDWriter

RETRY_AFTER_S = 30.0  # after a full disk, writes at the configured cap are tried again
RECONCILE_EVERY_S = 10.0  # the index is checked against the folder at most this often


def tier_folder(cache_dir: Path | str, fingerprint: str) -> Path:
    """The folder of the entries of the cache ``fingerprint`` names under ``cache_dir``."""
    return Path(cache_dir) / fingerprint[:16]


class SSDTier:
    """Persistent entries of one model under a byte cap, LRU by last access.

    ``on_idle``, when set, is called on the writer thread each time the writer has emptied
    its queue: the copies it read from the host are free by then (the engine then clears
    MLX's buffer cache, see :meth:`~tierchat.core.engine.engine.Engine.release_host_buffers`).

    ``writer`` (:class:`~.writer.SSDWriter`) holds the entries accepted and not yet on
    disk, and the writer's test hooks (``write_delay_s``, ``write_jitter_s``);
    ``verify_at_start`` turns the background verifier off. ``model``, when given, is
    recorded in the folder for commands run without ``--model`` (:mod:`.model_file`).

    ``ledger`` (:mod:`.wear`) records every file written and holds the write budget: an
    entry that does not fit it is not accepted (``budget_skips``, ``budget_skipped_bytes``).
    Under the cap an entry never evicts its parent: when nothing else can go it is not
    accepted (``cap_skips``; :meth:`_evict_for`).
    """

    on_idle: Callable[[], None] | None = None
    verify_at_start: bool = True
    clock: Callable[[], float] = staticmethod(time.monotonic)  # for :meth:`reconcile`

    def __init__(
        self,
        cache_dir: Path,
        fingerprint: str,
        max_bytes: int,
        queue_size: int = 64,
        on_event=None,
        max_pending_bytes: int = 1 << 30,
        ledger: WriteLedger | None = None,
        model: str = "",
    ) -> None:
        self.fingerprint = fingerprint
        self.ledger = ledger if ledger is not None else WriteLedger(None)
        self.budget_skips = self.budget_skipped_bytes = 0
        self.max_bytes = max_bytes
        self.configured_max_bytes = max_bytes  # max_bytes shrinks on a full disk
        self._retry_at = 0.0  # monotonic time to try the configured cap again
        self.cache_root = Path(cache_dir)
        self._locked = False
        self.dir = tier_folder(cache_dir, fingerprint)
        self.root = _root_id(fingerprint)
        self._on_event = on_event or (lambda text: None)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index = EntryIndex(self.root)  # in LRU order, least recent first
        self.writer = SSDWriter(
            self._cond,
            path_of=self._path,
            prepare_dir=self._prepare_dir,
            on_failed=self._write_failed,
            on_idle=self._writer_idle,
            on_event=self._event,
            ledger=self.ledger,
            queue_size=queue_size,
            max_pending_bytes=max_pending_bytes,
        )
        self.reader = SSDReader(
            lock=self._lock,
            index=self._index,
            writer=self.writer,
            path_of=self._path,
            fingerprint=fingerprint,
            counted=self._count_hit,
            condemn=self.condemn,
            forget=self.forget,
            count_error=self.count_error,
        )
        self.hits = self.misses = self.evictions = 0
        self.evicted_bytes = 0  # bytes of the entries evicted under the cap
        # entries not written because the cap cannot hold them beside their parent
        # (their chain's prefix is kept instead; docs/DESIGN.md §8.4)
        self.cap_skips = 0
        self.memory_hits = 0  # loads served from a pending entry's arrays
        self.write_drops = 0
        self.errors = self.corrupt = 0
        self.enabled = True
        self.reason = ""
        self._verifier = StartupVerifier([], self, self.writer.wait_unheld)
        self.reconciled_at = self.clock()  # the start-up scan read the folder
        try:
            private_dirs(Path(cache_dir))
            acquire_dir(Path(cache_dir))
            self._locked = True
            writable_dir(self.dir)
            for meta in scan_entries(self.dir, self.fingerprint, self):
                self._index.add(meta)
        except (OSError, CacheDirBusy) as exc:
            self.enabled = False
            if isinstance(exc, CacheDirBusy):
                self.reason = f"{exc}; SSD tier off (one process owns a cache dir)"
            else:
                self.reason = (
                    f"cache dir {self.dir} is not writable ({exc.strerror or exc}); SSD tier off"
                )
            if self._locked:
                release_dir(self.cache_root)
                self._locked = False
            self._on_event(f"warning: {self.reason}")
            self._verifier.done.set()
            return
        if model:  # what the folder's hashed name cannot say (:mod:`.model_file`)
            try:
                write_model_file(self.dir, model, fingerprint)
            except OSError as exc:
                self.count_error(f"cannot record the model in {self.dir}: {exc.strerror or exc}")
        self.writer.start()
        todo = list(self._index) if self.verify_at_start else []
        self._verifier = StartupVerifier(todo, self, self.writer.wait_unheld)
        self._verifier.start()

    # ------------------------------------------------------------------ index
    def _path(self, entry_id: str) -> Path:
        return self.dir / entry_id[:2] / f"{entry_id}.safetensors"

    def _event(self, text: str) -> None:
        try:
            self._on_event(text)
        except Exception:  # a logging callback never breaks the tier
            pass

    # what the checks find (:class:`~.verifier.Findings`)
    def remove_file(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            self.count_error(f"cannot remove {path.name}: {exc.strerror or exc}")

    def count_error(self, text: str) -> None:
        with self._lock:
            self.errors += 1
        self._event(f"SSD: {text}")

    def corrupt_file(self, path: Path, reason: str, remove: bool) -> None:
        with self._lock:
            self.corrupt += 1
        self._event(f"corrupt SSD entry {path.name[:12]} skipped: {reason}")
        if remove:
            self.remove_file(path)

    def _drop(self, entry_id: str) -> FileMeta | None:
        # caller holds the lock; a pending write of the entry is abandoned
        meta = self._index.pop(entry_id)
        if meta is None:
            return None
        if not self.writer.abandon(entry_id):
            try:
                self._path(entry_id).unlink(missing_ok=True)
            except OSError as exc:
                self.errors += 1
                self._event(f"SSD: cannot remove {entry_id[:12]}: {exc.strerror or exc}")
        return meta

    def written_file(self, entry_id: str) -> Path | None:
        """The file of a held entry that is on disk; None when it is pending or not held."""
        with self._lock:
            if entry_id not in self._index or entry_id in self.writer.pending:
                return None
        return self._path(entry_id)

    def condemn(self, entry_id: str, reason: str, ino: int | None = None) -> None:
        """Count and drop a corrupt entry, unless it changed since it was read (``ino``)."""
        with self._lock:
            if entry_id not in self._index:
                return
            if ino is not None:
                if entry_id in self.writer.pending:
                    return
                try:
                    if os.lstat(self._path(entry_id)).st_ino != ino:
                        return
                except OSError:
                    pass
            self.corrupt += 1
            self._drop(entry_id)
        self._event(f"corrupt SSD entry {entry_id[:12]} removed: {reason}")

    def forget(self, entry_id: str) -> None:
        """Drop an entry whose file is gone (not corrupt: someone removed it)."""
        with self._lock:
            if entry_id not in self._index or entry_id in self.writer.pending:
                return
            self._drop(entry_id)
        self._event(f"SSD entry {entry_id[:12]} missing from disk; forgotten")

    def _forget_missing(self) -> int:
        """Drop every written entry whose file is gone (the dir was removed); returns how
        many. Writer thread, after recreating the dir."""
        return self._forget_gone(entry_file_names(self.dir) or set())

    def _forget_gone(self, names: set[str]) -> int:
        """Drop the written entries whose files are not among ``names`` and, checked with
        ``lstat`` under the lock, not on disk; returns how many."""
        gone = 0
        with self._lock:
            for entry_id in list(self._index):
                if entry_id in self.writer.pending or f"{entry_id}.safetensors" in names:
                    continue
                try:
                    os.lstat(self._path(entry_id))
                except FileNotFoundError:
                    self._drop(entry_id)
                    gone += 1
                except OSError:
                    pass
        return gone

    def reconcile(self) -> int:
        """Forget the written entries whose files are gone (removed by hand, by another
        tool), if :data:`RECONCILE_EVERY_S` seconds have passed on :attr:`clock` since the
        last check; returns how many. Lists the entry folders (one ``scandir`` each) and
        reads no file; an entry missing from the listing is confirmed with ``lstat`` under
        the lock, which the writer holds while it renames a file into place, so an entry
        written meanwhile stays. A folder that cannot be listed (other than missing) skips
        the check. One event names the count."""
        now = self.clock()
        if not self.enabled or now - self.reconciled_at < RECONCILE_EVERY_S:
            return 0
        self.reconciled_at = now
        names = entry_file_names(self.dir)
        if names is None:
            return 0
        gone = self._forget_gone(names)
        if gone:
            self._event(f"SSD: {gone} entries missing from disk; forgotten")
        return gone

    def meta(self, entry_id: str) -> FileMeta | None:
        with self._lock:
            return self._index.get(entry_id)

    def __contains__(self, entry_id: str) -> bool:
        with self._lock:
            return entry_id in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        """The bytes of the entries held (their files, pending ones included)."""
        return self._index.nbytes

    def children_of(self, parent: str) -> list[FileMeta]:
        """Entries (blocks and tails) whose parent is ``parent``, in id order."""
        with self._lock:
            return self._index.children_of(parent)

    def tail_ids(self) -> list[str]:
        with self._lock:
            return self._index.tail_ids()

    @property
    def queue_depth(self) -> int:
        """Entries accepted and not yet on disk."""
        return len(self.writer.pending)

    @property
    def pending_bytes(self) -> int:
        return self.writer.pending_bytes

    # the writer's counters, read where the tier's stats are (bytes_queued: of the files
    # accepted for writing by :meth:`put_many`)
    saves_queued = property(lambda self: self.writer.saves_queued)
    saves_persisted = property(lambda self: self.writer.saves_persisted)
    bytes_queued = property(lambda self: self.writer.bytes_queued)
    backpressure_waits = property(lambda self: self.writer.backpressure_waits)
    backpressure_s = property(lambda self: self.writer.backpressure_s)

    # ------------------------------------------------------------------ writes
    def put(self, e: Entry) -> bool:
        """:meth:`put_many` of one entry."""
        return self.put_many([e])[0]

    def put_many(self, entries: list[Entry]) -> list[bool]:
        """Accept entries (arrays already evaluated): indexed at once, written later.

        The writer gets a copy of each accepted entry's bytes in pieces of at most
        ``io.PIECE_BYTES`` (:func:`copy_pieces`, engine thread), never the entries' own
        arrays; the copies are made and handed over a batch of about
        ``max_pending_bytes`` at a time (one eval each), parents first, so neither one
        array nor the copies in RAM grow with the session. Evicts least recently used
        entries to stay under ``max_bytes``. Blocks while the writer is more than
        ``queue_size`` entries or ``max_pending_bytes`` behind. Per entry, False when the
        tier is off, the entry is already held with at least as much, it is larger than
        the cap or has an unstorable dtype, its copy failed (an MLX error: the rest are
        still written), or the writer stayed stuck for ``backpressure_timeout_s`` (the
        last four counted in ``write_drops``).
        """
        if not self.enabled:
            return [False] * len(entries)
        if self._retry_at and time.monotonic() >= self._retry_at:
            with self._lock:
                self._retry_at = 0.0
                self.max_bytes = self.configured_max_bytes
                self.reason = ""
            self._event(f"SSD: retrying writes at the {self.max_bytes}-byte cap after a full disk")
        # one entry per id: the one carrying the most parts (a put of each in turn would
        # keep that one too)
        best: dict[str, int] = {}
        for i, e in enumerate(entries):
            j = best.get(e.id)
            f = entries[j] if j is not None else None
            if f is None or (e.window, e.snapshot, e.logprobs) > (f.window, f.snapshot, f.logprobs):
                best[e.id] = i
        results = [False] * len(entries)
        batch: list[tuple[int, Pending]] = []
        held = 0  # bytes of this call's entries, for the write budget
        # parents before children (a parent starts earlier), so each finds its parent held
        for i in sorted(best.values(), key=lambda i: entries[i].start):
            e = entries[i]
            with self._lock:
                if self._index.holds(e):
                    continue
            try:
                head, data = entry_header(e, self.fingerprint)
            except ValueError as exc:
                self._refuse(str(exc))
                continue
            if len(head) + data > self.max_bytes:
                self._refuse(f"entry of {len(head) + data} bytes exceeds the cap")
                continue
            room = self.ledger.room(self.writer.pending_bytes + held)
            if room is not None and len(head) + data > room:
                with self._lock:
                    self.budget_skips += 1
                    self.budget_skipped_bytes += len(head) + data
                continue
            held += len(head) + data
            batch.append((i, Pending(replace(e, arrays=dict(e.arrays)), head, len(head) + data)))
            if sum(p.nbytes for _, p in batch) >= self.writer.max_pending_bytes:
                self._hand_over(batch, results)
                batch, held = [], 0  # pending from here
        self._hand_over(batch, results)
        return results

    def _hand_over(self, batch: list[tuple[int, Pending]], results: list[bool]) -> None:
        """Copy a batch's bytes in pieces (one eval) and queue its entries in order."""
        if not batch:
            return
        try:
            for _, item in batch:
                e = item.entry
                item.pieces = copy_pieces([e.arrays[name] for name in sorted(e.arrays)])
            mx.eval([p for _, item in batch for p in item.pieces])
        except Exception as exc:  # an MLX error: these entries are lost, the rest written
            for _, item in batch:
                item.pieces = None
                self._refuse(f"copy of {item.entry.id[:12]} failed ({exc})")
            return
        for i, item in batch:
            results[i] = self._enqueue(item)

    def _enqueue(self, item: Pending) -> bool:
        e, size = item.entry, item.nbytes
        with self._cond:
            if not self.writer.wait_for_room(size):
                self.write_drops += 1
                self._event("SSD writer stuck: entry not saved")
                return False
            if e.id in self._index:
                self._drop(e.id)  # replaced by an entry with more parts
            orphan = e.parent != self.root and e.parent not in self._index
            if orphan and self.nbytes + size > self.max_bytes:
                # unreachable until its parent arrives: it may take free room, never
                # another chain's entries (a chain too long for the cap keeps its head)
                self.cap_skips += 1
                return False
            if not self._evict_for(size, keep=e.parent):
                self.cap_skips += 1  # the cap holds its chain only up to its parent
                return False
            self._index.add(FileMeta(**e.meta(), nbytes=size, atime=time.time()))
            self.writer.enqueue(item)
        return True

    def _refuse(self, text: str) -> bool:
        with self._lock:
            self.write_drops += 1
        self._event(f"SSD: {text}; not saved")
        return False

    # the writer's callbacks (writer thread)
    def _prepare_dir(self, path: Path) -> None:
        if not self.dir.is_dir():
            self._recreate_dir()
        _real_dir(path.parent)

    def _write_failed(self, item: Pending, exc: Exception) -> str:
        """A write failed (the lock is held): counted, the entry dropped if still pending;
        a full disk shrinks the cap to what is on disk until :data:`RETRY_AFTER_S` has
        passed. Returns the event's text."""
        self.errors += 1
        if self.writer.pending.get(item.entry.id) is item:
            self._drop(item.entry.id)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            on_disk = self.nbytes - self.writer.pending_bytes
            self.max_bytes = max(0, min(self.max_bytes, on_disk))
            self._evict_for(0)
            self._retry_at = time.monotonic() + RETRY_AFTER_S
            text = (
                f"disk full: SSD cap shrunk to {self.max_bytes} bytes "
                f"(writes retried in {RETRY_AFTER_S:.0f} s)"
            )
            if self.max_bytes == 0:
                text += "; SSD tier off until then"
            self.reason = text
            return text
        return f"SSD write failed: {getattr(exc, 'strerror', None) or exc}"

    def _writer_idle(self) -> None:
        if self.on_idle is not None:
            self.on_idle()

    def _recreate_dir(self) -> None:
        """The cache dir vanished (``rm -rf`` while running): make it again (0700, the
        lock file too) and forget the entries that went with it (writer thread)."""
        private_dirs(self.dir)
        gone = self._forget_missing()
        self._event(
            f"SSD write failed: cache dir {self.dir} was missing; recreated ({gone} "
            "entries lost with it)"
        )
        if self._locked and not (self.cache_root / LOCK_FILE).exists():
            # the lock file went with the dir: take a new one
            try:
                relock_dir(self.cache_root)
            except (OSError, CacheDirBusy) as exc:
                self._event(f"SSD: cannot lock {self.cache_root} again: {exc}")

    def _evict_for(self, incoming: int, keep: str | None = None) -> bool:
        """Evict until ``incoming`` more bytes fit under the cap, leaves first (see
        :meth:`EntryIndex.victim <.index.EntryIndex.victim>`); caller holds the lock. ``keep``: the parent of the
        entry being added, never evicted for it. False when room cannot be made without
        it (a chain longer than the cap keeps its prefix: the new entry is not written)."""
        while self._index and self.nbytes + incoming > self.max_bytes:
            victim = self._index.victim(keep)
            if victim is None:
                return False
            meta = self._drop(victim)
            self.evictions += 1
            self.evicted_bytes += meta.nbytes if meta is not None else 0
        return True

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every accepted entry is on disk (or dropped); False on timeout."""
        if not self.enabled:
            return True
        return self.writer.flush(timeout)

    def pause(self, holder: Any = None) -> None:
        """Hold the writer and the start-up verifier (between files) until every holder
        has called :meth:`resume`: a request while it prefills and produces a first token,
        so disk work never competes with TTFT, and, where host reads of device memory
        slow the kernels after them (CUDA: :meth:`Engine.release_host_buffers
        <tierchat.core.engine.engine.Engine.release_host_buffers>`), the engine while any
        request is held. Entries stay indexed and loadable; backpressure and
        :meth:`flush` let the writer run anyway until its queue empties.
        ``holder``: any hashable key (None: one shared key)."""
        self.writer.pause(holder)

    def resume(self, holder: Any = None) -> None:
        """Give up ``holder``'s hold (no effect if it holds none)."""
        self.writer.resume(holder)

    @property
    def held(self) -> bool:
        """Whether a holder keeps the writer waiting now (and no flush or backpressure
        overrides it)."""
        return self.writer.held

    def wait_verified(self, timeout: float | None = None) -> bool:
        """Wait for the start-up verifier to have read every file found at start."""
        return self._verifier.wait(timeout)

    def drop_pending(self) -> int:
        """Forget every entry not yet on disk (its write is abandoned); returns how many.
        For a bounded exit: what a flush did not write in time."""
        with self._cond:
            ids = list(self.writer.pending)
            for entry_id in ids:
                self._drop(entry_id)
            self.write_drops += len(ids)
        return len(ids)

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued (waiting at most ``timeout_s``; what is left then is
        dropped and reported), stop the threads, give back the cache dir's lock."""
        self.reader.close()
        if self.enabled:
            if not self.flush(timeout_s):
                dropped = self.drop_pending()
                self._event(
                    f"SSD write failed: {dropped} entries not saved at exit "
                    f"(the writer took over {timeout_s:g} s)"
                )
            self.writer.stop(timeout_s=5)
            self._verifier.join(timeout_s=5)
        self.ledger.save()
        if self._locked:
            self._locked = False
            release_dir(self.cache_root)

    # ------------------------------------------------------------------ reads
    def load(self, entry_id: str, expected: dict[str, tuple] | None = None) -> Entry | None:
        """One entry's arrays as MLX arrays (engine thread), or None: a miss, a corrupt,
        missing or unreadable file (:meth:`.reader.SSDReader.load`; reads ahead and
        prefetches are :attr:`reader`'s too). ``expected`` maps names to ``(shape, dtype)``
        with ``-1`` for the token axis (:func:`check_arrays`)."""
        return self.reader.load(entry_id, expected)

    def _count_hit(self, from_memory: bool) -> None:
        with self._lock:
            self.hits += 1
            self.memory_hits += from_memory

    # ------------------------------------------------------------------ admin
    def remove(self, entry_id: str) -> None:
        with self._lock:
            self._drop(entry_id)

    def clear(self) -> int:
        """Remove every entry, pending ones included; returns how many."""
        with self._lock:
            ids = list(self._index)
            for i in ids:
                self._drop(i)
        return len(ids)
