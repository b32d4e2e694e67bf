"""The SSD tier: one safetensors file per entry, written by one writer thread.

Layout: ``<cache_dir>/<fingerprint[:16]>/<id[:2]>/<id>.safetensors``, directories 0700 and
files 0600. A file is written to ``<id>.<pid>.<n>.tmp`` and renamed into place.

The file format is :mod:`.format`'s (``tierchat-kv/2``, checksummed safetensors).

At start the index is rebuilt from headers (length, hcrc, fields, id hash), and a
background verifier then reads every file once and checks ``dcrc``; a load checks both
CRCs again. A checksum or format failure makes an entry *corrupt*: counted, logged with
the reason, removed when possible, never loaded. A resource error (EMFILE, ENFILE,
ENOMEM, EACCES, EIO...: an ``OSError`` other than a missing file) is not corruption: the
load is a miss, counted in ``errors`` and logged, and the file stays for a later retry
(docs/DESIGN.md §8.4). A file found missing leaves the index (someone removed it). The scan takes
regular files only (``lstat``), never follows a symbolic link, never opens a FIFO or a
device, counts a failed ``unlink`` instead of raising, and removes a ``.tmp`` file only
when its writer is gone (PID in the name) or it is older than :data:`STALE_TMP_S`.

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
eviction are applied in ``put``, on the engine thread. When more than ``queue_size``
entries or ``max_pending_bytes`` wait for the writer, ``put`` blocks the engine thread
until the writer catches up (backpressure) instead of dropping: so what a lookup sees is
a function of the calls made, not of the writer's progress. Only a disk error (ENOSPC,
EIO...) or a writer stuck for ``backpressure_timeout_s`` loses an entry, counted.

Threads: the engine thread calls ``put`` (already evaluated arrays), ``load`` and the
queries; the writer and verifier threads handle numpy views and bytes only and never build
an MLX graph; the reader threads of a restore write file bytes into the memory of staging
arrays the engine made (:func:`staging`, :func:`read_file`). The index is guarded by one
lock.
"""


from __future__ import annotations

import errno
import itertools
import os
import random
import stat
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from ...files import pid_alive, private_dirs
from ..blocks import (
    KIND_BLOCK,
    Entry,
    EntryMeta,
)
from ..blocks import root_id as _root_id
from ..dir_lock import LOCK_FILE, CacheDirBusy, acquire_dir, release_dir, relock_dir
from ..wear import WriteLedger
from .format import (
    _NAME_OF,
    CorruptEntry,
    FileMeta,
    _meta_strings,
    check_arrays,
    encode_header,
    entry_meta,
    parse_header,
    seal_header,
)
from .io import (
    _flat_copy,
    _inode,
    _open_regular,
    _raw_bytes,
    _read_head,
    _real_dir,
    arrays_in,
    read_file,
    staging,
)

STALE_TMP_S = 600.0  # a .tmp file this old is removed even when its writer may live
RETRY_AFTER_S = 30.0  # after a full disk, writes at the configured cap are tried again


@dataclass(eq=False)
class _Pending:
    """An entry accepted by ``put`` and not yet on disk."""

    entry: Entry  # the arrays as given (what a load returns meanwhile)
    head: bytes  # encode_header(...), CRCs not yet filled
    nbytes: int  # the file's size
    blob: mx.array | None = None  # the tensor bytes, shared with the batch's other entries
    begin: int = 0  # this entry's bytes are blob[begin:end]
    end: int = 0


class SSDTier:
    """Persistent entries of one model under a byte cap, LRU by last access.

    ``on_idle``, when set, is called on the writer thread each time the writer has emptied
    its queue: the copies it read from the host are free by then (the engine then clears
    MLX's buffer cache, see :meth:`~tierchat.core.engine.engine.Engine.release_host_buffers`).

    Test hooks: ``write_delay_s`` (every write sleeps this long first) and
    ``write_jitter_s`` (plus a random ``[0, write_jitter_s)``), as instance or class
    attributes; ``verify_at_start`` turns the background verifier off.

    ``ledger`` (:mod:`.wear`) records every file written and holds the write budget: an
    entry that does not fit it is not accepted (``budget_skips``, ``budget_skipped_bytes``).
    Under the cap an entry never evicts its parent: when nothing else can go it is not
    accepted (``cap_skips``; :meth:`_evict_for`).
    """

    write_delay_s: float = 0.0
    write_jitter_s: float = 0.0
    on_idle: Callable[[], None] | None = None
    verify_at_start: bool = True
    backpressure_timeout_s: float = 120.0
    close_timeout_s: float = 60.0  # close waits this long for the writer, then drops the rest

    def __init__(
        self,
        cache_dir: Path,
        fingerprint: str,
        max_bytes: int,
        queue_size: int = 64,
        on_event=None,
        max_pending_bytes: int = 1 << 30,
        ledger: WriteLedger | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        self.ledger = ledger if ledger is not None else WriteLedger(None)
        self.budget_skips = self.budget_skipped_bytes = 0
        self.bytes_queued = 0  # bytes of the files accepted for writing (put_many)
        self.max_bytes = max_bytes
        self.configured_max_bytes = max_bytes  # max_bytes shrinks on a full disk
        self._retry_at = 0.0  # monotonic time to try the configured cap again
        self.cache_root = Path(cache_dir)
        self._locked = False
        self.queue_size = max(1, queue_size)
        self.max_pending_bytes = max_pending_bytes
        self.dir = Path(cache_dir) / fingerprint[:16]
        self.root = _root_id(fingerprint)
        self._on_event = on_event or (lambda text: None)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index: dict[str, FileMeta] = {}  # in LRU order, least recent first
        self.children: dict[str, set[str]] = {}  # parent id -> ids of entries after it
        self._pending: dict[str, _Pending] = {}
        # who holds the writer now (requests before their first token, the engine while
        # it decodes: :meth:`pause`); ``_force`` lets it run anyway until its queue empties
        self._holds: set[Any] = set()
        self._force = False
        self._flushing = 0  # flush() calls waiting: no hold applies meanwhile
        # files being read ahead of their load by worker threads (pure I/O and CRC)
        self._reads: dict[str, tuple[mx.array, Future]] = {}
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tierchat-ssd-read")
        self._pending_bytes = 0
        self._queue: list[_Pending | None] = []
        self._tmp_seq = itertools.count()
        self._stop = False
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self.evicted_bytes = 0  # bytes of the entries evicted under the cap
        # entries not written because the cap cannot hold them beside their parent
        # (their chain's prefix is kept instead; docs/DESIGN.md §8.4)
        self.cap_skips = 0
        self.memory_hits = 0  # loads served from a pending entry's arrays
        self.saves_queued = self.saves_persisted = self.write_drops = 0
        self.backpressure_waits = 0
        self.backpressure_s = 0.0
        self.errors = self.corrupt = 0
        self.enabled = True
        self.reason = ""
        self._verified = threading.Event()
        try:
            private_dirs(Path(cache_dir))
            acquire_dir(Path(cache_dir))
            self._locked = True
            if self.dir.is_symlink():
                raise OSError(errno.ELOOP, "is a symbolic link")
            private_dirs(self.dir)
            probe = self.dir / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
            self._scan()
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
            self._verified.set()
            return
        self._writer = threading.Thread(
            target=self._write_loop, name="tierchat-ssd-writer", daemon=True
        )
        self._writer.start()
        todo = list(self._index) if self.verify_at_start else []
        self._verifier = threading.Thread(
            target=self._verify_loop, args=(todo,), name="tierchat-ssd-verifier", daemon=True
        )
        self._verifier.start()

    # ------------------------------------------------------------------ index
    def _path(self, entry_id: str) -> Path:
        return self.dir / entry_id[:2] / f"{entry_id}.safetensors"

    def _event(self, text: str) -> None:
        try:
            self._on_event(text)
        except Exception:  # a logging callback never breaks the tier
            pass

    def _scan(self) -> None:
        """Rebuild the index from headers. Raises OSError only if ``self.dir`` cannot be
        listed; any single bad path is counted and skipped."""
        found: list[FileMeta] = []
        with os.scandir(self.dir) as it:
            shards = list(it)
        for shard in shards:
            try:
                if shard.is_symlink():
                    self._bad(Path(shard.path), "symbolic link in the cache dir", remove=True)
                    continue
                if not shard.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(shard.path) as it:
                    entries = list(it)
            except OSError as exc:
                self._count_error(f"cannot read {shard.path}: {exc.strerror or exc}")
                continue
            for ent in entries:
                try:
                    meta = self._scan_one(ent)
                except Exception as exc:  # the scan survives any single bad path
                    self._bad(Path(ent.path), str(exc) or type(exc).__name__, remove=False)
                    continue
                if meta is not None:
                    found.append(meta)
        for meta in sorted(found, key=lambda m: (m.atime, m.id)):
            self._add(meta)

    def _scan_one(self, ent: os.DirEntry) -> FileMeta | None:
        path = Path(ent.path)
        st = ent.stat(follow_symlinks=False)
        if ent.name.endswith(".tmp"):
            self._sweep_tmp(path, st)
            return None
        if not ent.name.endswith(".safetensors"):
            return None
        if not stat.S_ISREG(st.st_mode):
            # a link, FIFO, socket or device is removed (unlink never follows); a
            # directory is left alone; nothing is opened
            self._bad(path, "not a regular file", remove=not stat.S_ISDIR(st.st_mode))
            return None
        try:
            f, st = _open_regular(path)
            with f:
                layout = parse_header(_read_head(f, st.st_size), st.st_size)
            m = entry_meta(layout.meta, self.fingerprint)
            if m.id + ".safetensors" != ent.name or m.id[:2] != path.parent.name:
                raise CorruptEntry("id does not match file name")
        except CorruptEntry as exc:
            self._bad(path, str(exc), remove=True)
            return None
        except FileNotFoundError:
            return None  # removed since listed
        except OSError as exc:  # EMFILE, EACCES, EIO...: kept for the next start
            self._count_error(f"cannot read {path.name[:12]} ({exc.strerror or exc}); kept")
            return None
        return FileMeta(**m.meta(), nbytes=st.st_size, atime=st.st_mtime)

    def _sweep_tmp(self, path: Path, st: os.stat_result) -> None:
        """Remove a temp file whose writer is gone or that is older than STALE_TMP_S."""
        if stat.S_ISDIR(st.st_mode):
            return
        parts = path.name.split(".")
        pid = int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None
        stale = time.time() - st.st_mtime > STALE_TMP_S
        if stale or (pid is not None and pid != os.getpid() and not pid_alive(pid)):
            self._unlink(path)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            self._count_error(f"cannot remove {path.name}: {exc.strerror or exc}")

    def _count_error(self, text: str) -> None:
        with self._lock:
            self.errors += 1
        self._event(f"SSD: {text}")

    def _bad(self, path: Path, reason: str, remove: bool) -> None:
        with self._lock:
            self.corrupt += 1
        self._event(f"corrupt SSD entry {path.name[:12]} skipped: {reason}")
        if remove:
            self._unlink(path)

    def _add(self, meta: FileMeta) -> None:
        # caller holds the lock (or is the constructor)
        old = self._index.pop(meta.id, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._index[meta.id] = meta
        self.nbytes += meta.nbytes
        self.children.setdefault(meta.parent, set()).add(meta.id)

    def _drop(self, entry_id: str) -> FileMeta | None:
        # caller holds the lock; a pending write of the entry is abandoned
        meta = self._index.pop(entry_id, None)
        if meta is None:
            return None
        self.nbytes -= meta.nbytes
        ids = self.children.get(meta.parent)
        if ids is not None:
            ids.discard(entry_id)
            if not ids:
                del self.children[meta.parent]
        item = self._pending.pop(entry_id, None)
        if item is not None:
            self._pending_bytes -= item.nbytes
            self._cond.notify_all()
        else:
            try:
                self._path(entry_id).unlink(missing_ok=True)
            except OSError as exc:
                self.errors += 1
                self._event(f"SSD: cannot remove {entry_id[:12]}: {exc.strerror or exc}")
        return meta

    def _condemn(self, entry_id: str, reason: str, ino: int | None = None) -> None:
        """Count and drop a corrupt entry, unless it changed since it was read (``ino``)."""
        with self._lock:
            if entry_id not in self._index:
                return
            if ino is not None:
                if entry_id in self._pending:
                    return
                try:
                    if os.lstat(self._path(entry_id)).st_ino != ino:
                        return
                except OSError:
                    pass
            self.corrupt += 1
            self._drop(entry_id)
        self._event(f"corrupt SSD entry {entry_id[:12]} removed: {reason}")

    def _forget(self, entry_id: str) -> None:
        """Drop an entry whose file is gone (not corrupt: someone removed it)."""
        with self._lock:
            if entry_id not in self._index or entry_id in self._pending:
                return
            self._drop(entry_id)
        self._event(f"SSD entry {entry_id[:12]} missing from disk; forgotten")

    def _forget_missing(self) -> int:
        """Drop every written entry whose file is gone (the dir was removed); returns how
        many. Writer thread, after recreating the dir."""
        with self._lock:
            ids = [i for i in self._index if i not in self._pending]
        gone = [i for i in ids if not self._path(i).exists()]
        with self._lock:
            for entry_id in gone:
                if entry_id not in self._pending:
                    self._drop(entry_id)
        return len(gone)

    def meta(self, entry_id: str) -> FileMeta | None:
        with self._lock:
            return self._index.get(entry_id)

    def __contains__(self, entry_id: str) -> bool:
        with self._lock:
            return entry_id in self._index

    def __len__(self) -> int:
        return len(self._index)

    def children_of(self, parent: str) -> list[FileMeta]:
        """Entries (blocks and tails) whose parent is ``parent``, in id order."""
        with self._lock:
            return [self._index[i] for i in sorted(self.children.get(parent, ()))]

    def tail_ids(self) -> list[str]:
        with self._lock:
            return [i for i, m in self._index.items() if m.kind != KIND_BLOCK]

    @property
    def queue_depth(self) -> int:
        """Entries accepted and not yet on disk."""
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    # ------------------------------------------------------------------ writes
    def put(self, e: Entry) -> bool:
        """:meth:`put_many` of one entry."""
        return self.put_many([e])[0]

    def put_many(self, entries: list[Entry]) -> list[bool]:
        """Accept entries (arrays already evaluated): indexed at once, written later.

        The writer gets a copy of the accepted entries' bytes in one flat array
        (:func:`_flat_copy`; one concatenate and one eval on the engine thread), never the
        entries' own arrays. Evicts least recently used entries to stay under
        ``max_bytes``. Blocks while the writer is more than ``queue_size`` entries or
        ``max_pending_bytes`` behind. Per entry, False when the tier is off, the entry is
        already held with at least as much, it is larger than the cap or has an
        unstorable dtype, or the writer stayed stuck for ``backpressure_timeout_s`` (the
        last three counted in ``write_drops``).
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
        accepted, flat, offset = [], [], 0
        results = [False] * len(entries)
        for i, e in enumerate(entries):
            if best[e.id] != i:
                continue
            with self._lock:
                old = self._index.get(e.id)
                if (
                    old is not None
                    and (old.window or not e.window)
                    and (old.snapshot or not e.snapshot)
                    and (old.logprobs or not e.logprobs)
                ):
                    continue
            names = sorted(e.arrays)
            specs = []
            for name in names:
                a = e.arrays[name]
                dtype = _NAME_OF.get(a.dtype)
                if dtype is None:
                    self._refuse(f"dtype {a.dtype} of {name} cannot be stored")
                    break
                specs.append((name, dtype, tuple(a.shape), a.nbytes))
            else:
                head = encode_header(_meta_strings(e, self.fingerprint), specs)
                data = sum(s[3] for s in specs)
                if len(head) + data > self.max_bytes:
                    self._refuse(f"entry of {len(head) + data} bytes exceeds the cap")
                    continue
                room = self.ledger.room(self._pending_bytes + sum(a[1].nbytes for a in accepted))
                if room is not None and len(head) + data > room:
                    with self._lock:
                        self.budget_skips += 1
                        self.budget_skipped_bytes += len(head) + data
                    continue
                item = _Pending(replace(e, arrays=dict(e.arrays)), head, len(head) + data)
                item.begin, item.end = offset, offset + data
                offset += data
                flat += [e.arrays[name] for name in names]
                accepted.append((i, item))
        if not accepted:
            return results
        blob = _flat_copy(flat)
        mx.eval(blob)
        # parents before children (a parent starts earlier), so each finds its parent held
        for i, item in sorted(accepted, key=lambda a: a[1].entry.start):
            item.blob = blob
            results[i] = self._enqueue(item)
        return results

    def _enqueue(self, item: _Pending) -> bool:
        e, size = item.entry, item.nbytes
        with self._cond:
            if not self._wait_for_room(size):
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
            self._add(FileMeta(**e.meta(), nbytes=size, atime=time.time()))
            self._pending[e.id] = item
            self._pending_bytes += size
            self.saves_queued += 1
            self.bytes_queued += size
            self._queue.append(item)
            self._cond.notify_all()
        return True

    def _refuse(self, text: str) -> bool:
        with self._lock:
            self.write_drops += 1
        self._event(f"SSD: {text}; not saved")
        return False

    def _wait_for_room(self, size: int) -> bool:
        # caller holds the lock; backpressure on the engine thread
        def full() -> bool:
            return bool(self._pending) and (
                len(self._pending) >= self.queue_size
                or self._pending_bytes + size > self.max_pending_bytes
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

    def _write_loop(self) -> None:
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
                    self.errors += 1
                    if self._pending.get(item.entry.id) is item:
                        self._drop(item.entry.id)
                self._event(f"SSD write failed: {exc}")
            finally:
                item.blob = None  # the batch's copy goes when its last entry is written
            with self._cond:
                idle = not self._queue
                if idle:
                    self._force = False
            if idle and self.on_idle is not None:
                self.on_idle()

    def _write(self, item: _Pending) -> None:
        eid = item.entry.id
        with self._lock:
            if self._pending.get(eid) is not item:
                return  # evicted, removed or replaced since
        data = _raw_bytes(item.blob)[item.begin : item.end]
        head = seal_header(item.head, zlib.crc32(data))
        path = self._path(eid)
        tmp = path.with_name(f"{eid}.{os.getpid()}.{next(self._tmp_seq)}.tmp")
        try:
            if not self.dir.is_dir():
                self._recreate_dir()
            _real_dir(path.parent)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(tmp, flags, 0o600)
            with open(fd, "wb") as f:
                f.write(head)
                f.write(memoryview(data))
            with self._cond:
                if self._pending.get(eid) is item:
                    os.replace(tmp, path)
                    del self._pending[eid]
                    self._pending_bytes -= item.nbytes
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
                self.errors += 1
                if self._pending.get(eid) is item:
                    self._drop(eid)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    on_disk = self.nbytes - self._pending_bytes
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
                else:
                    text = f"SSD write failed: {exc.strerror or exc}"
            self._event(text)

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
        :meth:`_eviction_victim`); caller holds the lock. ``keep``: the parent of the
        entry being added, never evicted for it. False when room cannot be made without
        it (a chain longer than the cap keeps its prefix: the new entry is not written)."""
        while self._index and self.nbytes + incoming > self.max_bytes:
            victim = self._eviction_victim(keep)
            if victim is None:
                return False
            meta = self._drop(victim)
            self.evictions += 1
            self.evicted_bytes += meta.nbytes if meta is not None else 0
        return True

    def _eviction_victim(self, keep: str | None = None) -> str | None:
        """The entry to evict next: the least recently used one that no entry in the
        index continues (a leaf of its chain), other than ``keep``. A restore walks a
        chain from the root, so a block whose descendants stayed would leave them
        unreachable: chains shrink from their ends, least recently used chain first
        (docs/DESIGN.md §8.4). An entry whose parent is not held (admission may write a
        child before its parent) is unreachable and goes first. None when only ``keep`` is
        left. Caller holds the lock."""
        leaf = None
        for entry_id, meta in self._index.items():  # least recently used first
            if self.children.get(entry_id) or entry_id == keep:
                continue
            if meta.parent != self.root and meta.parent not in self._index:
                return entry_id
            leaf = leaf or entry_id
        return leaf

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every accepted entry is on disk (or dropped); False on timeout."""
        if not self.enabled:
            return True
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: not self._pending, timeout)
            finally:
                self._flushing -= 1

    def pause(self, holder: Any = None) -> None:
        """Hold the writer and the start-up verifier (between files) until every holder
        has called :meth:`resume`: a request while it prefills and produces a first token,
        so disk work never competes with TTFT, and, where host reads of device memory
        slow the kernels after them (CUDA: :meth:`Engine.release_host_buffers
        <tierchat.core.engine.engine.Engine.release_host_buffers>`), the engine while any
        request is held. Entries stay indexed and loadable; backpressure and
        :meth:`flush` let the writer run anyway until its queue empties.
        ``holder``: any hashable key (None: one shared key)."""
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

    def wait_verified(self, timeout: float | None = None) -> bool:
        """Wait for the start-up verifier to have read every file found at start."""
        return self._verified.wait(timeout)

    def drop_pending(self) -> int:
        """Forget every entry not yet on disk (its write is abandoned); returns how many.
        For a bounded exit: what a flush did not write in time."""
        with self._cond:
            ids = list(self._pending)
            for entry_id in ids:
                self._drop(entry_id)
            self.write_drops += len(ids)
        return len(ids)

    def close(self) -> None:
        """Write what is queued (waiting at most ``close_timeout_s``; what is left then is
        dropped and reported), stop the threads, give back the cache dir's lock."""
        self.drop_reads()
        self._readers.shutdown(wait=True)
        if self.enabled:
            if not self.flush(self.close_timeout_s):
                dropped = self.drop_pending()
                self._event(
                    f"SSD write failed: {dropped} entries not saved at exit "
                    f"(the writer took over {self.close_timeout_s:g} s)"
                )
            with self._cond:
                self._holds.clear()
                self._stop = True
                self._queue.append(None)
                self._cond.notify_all()
            self._writer.join(timeout=5)
            self._verifier.join(timeout=5)
        self.ledger.save()
        if self._locked:
            self._locked = False
            release_dir(self.cache_root)

    # ------------------------------------------------------------------ verifier
    def _verify_loop(self, ids: list[str]) -> None:
        try:
            for entry_id in ids:
                with self._cond:
                    self._cond.wait_for(lambda: not self._held() or self._stop)
                if self._stop:
                    return
                with self._lock:
                    if entry_id not in self._index or entry_id in self._pending:
                        continue
                try:
                    read_file(self._path(entry_id), keep=False)
                except FileNotFoundError:
                    self._forget(entry_id)
                except CorruptEntry as exc:
                    ino = _inode(self._path(entry_id))
                    if ino is not None:
                        self._condemn(entry_id, str(exc), ino)
                except OSError as exc:  # a resource error: the file stays, unverified
                    self._count_error(f"cannot verify {entry_id[:12]} ({exc.strerror or exc})")
        finally:
            self._verified.set()

    # ------------------------------------------------------------------ reads
    def load(self, entry_id: str, expected: dict[str, tuple] | None = None) -> Entry | None:
        """One entry's arrays as MLX arrays (engine thread), or None.

        A pending entry comes from memory (the arrays ``put`` was given); otherwise the
        file is read whole into a staging array (:func:`read_file`), both CRCs checked,
        its header compared with the index, and its tensors viewed in place
        (:func:`arrays_in`). ``expected`` maps names to ``(shape, dtype)`` with
        ``-1`` for the token axis (:func:`check_arrays`). A checksum, format or shape
        failure: counted corrupt, logged, removed, None. A missing file: forgotten, None.
        Any other failure (EMFILE, ENOMEM, an MLX error): counted in ``errors``, logged,
        the file kept for a later load, None.
        """
        with self._lock:
            meta = self._index.get(entry_id)
            if meta is None:
                return None
            item = self._pending.get(entry_id)
            meta = replace(meta, atime=time.time())
            del self._index[entry_id]
            self._index[entry_id] = meta  # most recently used
        ino = None
        try:
            if item is not None:
                arrays = dict(item.entry.arrays)
            else:
                ahead = self._reads.pop(entry_id, None)
                if ahead is None:
                    stage = staging(meta.nbytes)
                    view = memoryview(stage).cast("B")
                    layout, _, ino = read_file(self._path(entry_id), into=view)
                else:
                    stage, read = ahead
                    layout, _, ino = read.result()
                if EntryMeta.meta(entry_meta(layout.meta, self.fingerprint)) != meta.meta():
                    raise CorruptEntry("file changed since indexed")
                arrays = arrays_in(layout, stage)
            if expected is not None:
                check_arrays(arrays, expected, len(meta.tokens))
        except CorruptEntry as exc:
            self._condemn(entry_id, str(exc))
            return None
        except FileNotFoundError:
            self._forget(entry_id)
            return None
        except Exception as exc:  # EMFILE, ENOMEM, an MLX error...: a miss, file kept
            text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._count_error(f"cannot read {entry_id[:12]} ({text or type(exc).__name__}); kept")
            return None
        if item is None:
            try:
                os.utime(self._path(entry_id), (meta.atime, meta.atime))
            except OSError:
                pass
        with self._lock:
            self.hits += 1
            self.memory_hits += item is not None
        entry = Entry(**EntryMeta.meta(meta), arrays=arrays)
        entry.nbytes = sum(a.nbytes for a in arrays.values())
        return entry

    def read_ahead(self, entry_ids) -> None:
        """Start reading and verifying these entries' files on worker threads (plain file
        I/O and CRC-32, which release the GIL; no MLX), each straight into a
        :func:`staging` array made here, one after the other, so the disk reads several
        files at once while the next staging array is made (engine thread). ``load``
        takes the result; a failed read raises there and is handled as any bad file."""
        for entry_id in entry_ids:
            with self._lock:
                meta = self._index.get(entry_id)
                if entry_id in self._pending or meta is None or entry_id in self._reads:
                    continue
            stage = staging(meta.nbytes)
            view = memoryview(stage).cast("B")
            read = self._readers.submit(read_file, self._path(entry_id), into=view)
            self._reads[entry_id] = (stage, read)

    def drop_reads(self) -> None:
        """Forget reads ahead that no load took (the restore changed its plan)."""
        reads, self._reads = self._reads, {}
        for _, read in reads.values():
            read.cancel()

    def prefetch(self, entry_ids) -> None:
        """Ask the kernel to start reading these entries' files now (``POSIX_FADV_WILLNEED``,
        asynchronous; a no-op where unsupported or for pending entries), so the loads of a
        long restore overlap their reads with each other's checks and copies."""
        if not hasattr(os, "posix_fadvise"):
            return
        for entry_id in entry_ids:
            if entry_id in self._pending or entry_id not in self._index:
                continue
            try:
                f, _ = _open_regular(self._path(entry_id))
                with f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
            except (OSError, CorruptEntry):
                pass  # the load will find out and count it

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
