"""The SSD tier: one safetensors file per entry, written by one writer thread.

Layout: ``<cache_dir>/<fingerprint[:16]>/<id[:2]>/<id>.safetensors``, directories 0700 and
files 0600. The header's ``__metadata__`` holds the format version, model fingerprint,
entry id, parent id, kind, start, token ids, role, flags and a sha256 over the tensors'
bytes (in name order). A file is written to ``<id>.<pid>.tmp`` and renamed, so a killed
writer leaves only temp files, which the next start removes.

At start the index is rebuilt from headers alone. A file whose header is unreadable, of
another format version or model, or whose size does not match its header, is counted as
corrupt and removed; on load the tensor hash and shapes are checked again, and a mismatch
is a miss (counted, file removed), never a restore.

Threads: the engine thread calls ``put`` (already evaluated arrays), ``load`` and the
queries; the writer thread turns arrays into numpy views and writes. The index is guarded
by one lock. No MLX graph is built off the engine thread.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save as st_save

from .blocks import FORMAT_VERSION, KIND_BLOCK, Entry, EntryMeta

FORMAT = f"tierchat-kv/{FORMAT_VERSION}"


@dataclass
class FileMeta(EntryMeta):
    """An index row: the entry's description plus its file's size and last access."""

    nbytes: int = 0  # file size
    atime: float = 0.0


class CorruptEntry(Exception):
    pass


def _tensor_hash(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def read_header(path: Path) -> tuple[dict, dict[str, str], int]:
    """Parse a safetensors header without reading tensors: ``(tensors, metadata, data_end)``.

    Raises:
        CorruptEntry: short file, absurd header length, bad JSON or bad offsets.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CorruptEntry("short file")
        (n,) = np.frombuffer(head, dtype="<u8")
        if n > 16 << 20:
            raise CorruptEntry("header too large")
        raw = f.read(int(n))
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptEntry(f"bad header: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptEntry("bad header")
    meta = header.pop("__metadata__", None) or {}
    try:
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise CorruptEntry("bad tensor offsets") from None
    return header, meta, 8 + int(n) + end


class SSDTier:
    """Persistent entries of one model under a byte cap, LRU by last access."""

    def __init__(
        self,
        cache_dir: Path,
        fingerprint: str,
        max_bytes: int,
        queue_size: int = 64,
        on_event=None,
    ) -> None:
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.dir = Path(cache_dir) / fingerprint[:16]
        self._on_event = on_event or (lambda text: None)
        self._lock = threading.Lock()
        self._index: dict[str, FileMeta] = {}
        self.children: dict[str, set[str]] = {}  # parent id -> ids of entries after it
        self._pending: set[str] = set()  # ids queued and not yet written
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self.saves_queued = self.saves_persisted = self.write_drops = 0
        self.errors = self.corrupt = 0
        self.enabled = True
        self.reason = ""
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self.write_delay_s = 0.0  # tests: a slow disk
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            probe = self.dir / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            self.enabled = False
            self.reason = (
                f"cache dir {self.dir} is not writable ({exc.strerror or exc}); SSD tier off"
            )
            self._on_event(f"warning: {self.reason}")
            return
        self._scan()
        self._writer = threading.Thread(
            target=self._write_loop, name="tierchat-ssd-writer", daemon=True
        )
        self._writer.start()

    # ------------------------------------------------------------------ index
    def _path(self, entry_id: str) -> Path:
        return self.dir / entry_id[:2] / f"{entry_id}.safetensors"

    def _scan(self) -> None:
        for path in self.dir.glob("*/*"):
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(".safetensors"):
                continue
            try:
                meta = self._check_header(path)
            except (CorruptEntry, OSError) as exc:
                self.corrupt += 1
                self._on_event(f"corrupt SSD entry {path.name[:12]} removed: {exc}")
                path.unlink(missing_ok=True)
                continue
            self._add(meta)

    def _check_header(self, path: Path) -> FileMeta:
        _, meta, end = read_header(path)
        size = path.stat().st_size
        if meta.get("format") != FORMAT:
            raise CorruptEntry(f"format {meta.get('format')!r}, expected {FORMAT}")
        if meta.get("fingerprint") != self.fingerprint:
            raise CorruptEntry("entry of another model")
        if meta.get("id") + ".safetensors" != path.name:
            raise CorruptEntry("id does not match file name")
        if size != end:
            raise CorruptEntry(f"size {size} != {end} (truncated or padded)")
        try:
            return FileMeta(
                id=meta["id"],
                parent=meta["parent"],
                kind=meta["kind"],
                start=int(meta["start"]),
                tokens=tuple(json.loads(meta["tokens"])),
                role=meta["role"],
                window=meta["window"] == "1",
                snapshot=meta["snapshot"] == "1",
                nbytes=size,
                atime=path.stat().st_mtime,
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise CorruptEntry(f"bad metadata: {exc}") from None

    def _add(self, meta: FileMeta) -> None:
        old = self._index.pop(meta.id, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._index[meta.id] = meta
        self.nbytes += meta.nbytes
        self.children.setdefault(meta.parent, set()).add(meta.id)

    def _drop(self, entry_id: str) -> FileMeta | None:
        meta = self._index.pop(entry_id, None)
        if meta is None:
            return None
        self.nbytes -= meta.nbytes
        ids = self.children.get(meta.parent)
        if ids is not None:
            ids.discard(entry_id)
            if not ids:
                del self.children[meta.parent]
        self._path(entry_id).unlink(missing_ok=True)
        return meta

    def meta(self, entry_id: str) -> FileMeta | None:
        with self._lock:
            return self._index.get(entry_id)

    def __contains__(self, entry_id: str) -> bool:
        with self._lock:
            return entry_id in self._index

    def __len__(self) -> int:
        return len(self._index)

    def children_of(self, parent: str) -> list[FileMeta]:
        """Entries (blocks and tails) whose parent is ``parent``."""
        with self._lock:
            return [self._index[i] for i in self.children.get(parent, ())]

    def tail_ids(self) -> list[str]:
        with self._lock:
            return [i for i, m in self._index.items() if m.kind != KIND_BLOCK]

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    # ------------------------------------------------------------------ writes
    def put(self, e: Entry) -> bool:
        """Queue an entry (arrays already evaluated) for writing. Never blocks.

        Returns False when the tier is off, the entry is already on disk with at least as
        much, or the queue is full (counted in ``write_drops``; the entry stays hot).
        """
        if not self.enabled:
            return False
        with self._lock:
            old = self._index.get(e.id)
            if e.id in self._pending or (
                old is not None
                and (old.window or not e.window)
                and (old.snapshot or not e.snapshot)
            ):
                return False
        arrays = {}
        bf16 = []
        for name, a in e.arrays.items():
            if a.dtype == mx.bfloat16:  # numpy has no bfloat16: store the bits
                a = a.view(mx.uint16)
                bf16.append(name)
            arrays[name] = a
        if bf16:
            mx.eval(list(arrays.values()))
        item = (replace(e, arrays=arrays), bf16)
        with self._lock:  # before queueing: the writer may finish it at once
            self._pending.add(e.id)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                self._pending.discard(e.id)
            self.write_drops += 1
            return False
        self.saves_queued += 1
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.write_delay_s:
                    time.sleep(self.write_delay_s)
                self._write(*item)
            except Exception as exc:  # never let the writer die: count and go on
                self.errors += 1
                self._on_event(f"SSD write failed: {exc}")
            finally:
                if item is not None:
                    with self._lock:
                        self._pending.discard(item[0].id)
                self._queue.task_done()

    def _write(self, e: Entry, bf16: list[str]) -> None:
        tensors = {name: np.ascontiguousarray(a) for name, a in e.arrays.items()}
        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "id": e.id,
            "parent": e.parent,
            "kind": e.kind,
            "start": str(e.start),
            "tokens": json.dumps(list(e.tokens)),
            "role": e.role,
            "window": "1" if e.window else "0",
            "snapshot": "1" if e.snapshot else "0",
            "bf16": json.dumps(bf16),
            "sha256": _tensor_hash(tensors),
        }
        data = st_save(tensors, metadata=meta)
        with self._lock:
            if self.nbytes + len(data) > self.max_bytes:
                self._evict_for(len(data))
            if len(data) > self.max_bytes:
                self.write_drops += 1
                return
        path = self._path(e.id)
        tmp = path.with_name(f"{e.id}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self.errors += 1
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                with self._lock:
                    self.max_bytes = max(0, min(self.max_bytes, self.nbytes))
                    self._evict_for(0)
                self._on_event(f"disk full: SSD cap shrunk to {self.max_bytes} bytes")
            else:
                self._on_event(f"SSD write failed: {exc.strerror or exc}")
            return
        with self._lock:
            self._add(FileMeta(**e.meta(), nbytes=len(data), atime=time.time()))
            self.saves_persisted += 1

    def _evict_for(self, incoming: int) -> None:
        # caller holds the lock
        for meta in sorted(self._index.values(), key=lambda m: m.atime):
            if self.nbytes + incoming <= self.max_bytes:
                return
            self._drop(meta.id)
            self.evictions += 1

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued entry is written (used before a restart and in tests)."""
        if not self.enabled:
            return
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        if self.enabled:
            self.flush()
            self._queue.put(None)
            self._writer.join(timeout=5)

    # ------------------------------------------------------------------ reads
    def load(self, entry_id: str, expected: dict[str, tuple] | None = None) -> Entry | None:
        """Read and verify one entry into MLX arrays (engine thread). None on any problem.

        ``expected`` maps array names to ``(shape, dtype)`` with ``-1`` for the token axis;
        every array must match and be present.
        """
        meta = self.meta(entry_id)
        if meta is None:
            return None
        path = self._path(entry_id)
        try:
            arrays = self._read(path, meta, expected)
        except (CorruptEntry, OSError, ValueError) as exc:
            self.corrupt += 1
            self._on_event(f"corrupt SSD entry {entry_id[:12]} removed: {exc}")
            with self._lock:
                self._drop(entry_id)
            return None
        now = time.time()
        with self._lock:
            if entry_id in self._index:
                self._index[entry_id] = replace(meta, atime=now)
        try:
            os.utime(path, (now, now))
        except OSError:
            pass
        self.hits += 1
        entry = Entry(**EntryMeta.meta(meta), arrays=arrays)
        entry.nbytes = sum(a.nbytes for a in arrays.values())
        return entry

    def _read(self, path: Path, meta: FileMeta, expected) -> dict[str, mx.array]:
        header, fmeta, end = read_header(path)
        if path.stat().st_size != end or fmeta.get("id") != meta.id:
            raise CorruptEntry("file changed since indexed")
        tensors = {}
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
        if _tensor_hash(tensors) != fmeta.get("sha256"):
            raise CorruptEntry("tensor checksum mismatch")
        bf16 = set(json.loads(fmeta.get("bf16", "[]")))
        arrays = {}
        for name, t in tensors.items():
            a = mx.array(t)
            arrays[name] = a.view(mx.bfloat16) if name in bf16 else a
        if expected is not None:
            check_arrays(arrays, expected, len(meta.tokens))
        return arrays

    # ------------------------------------------------------------------ admin
    def remove(self, entry_id: str) -> None:
        with self._lock:
            self._drop(entry_id)

    def clear(self) -> int:
        self.flush()
        with self._lock:
            ids = list(self._index)
            for i in ids:
                self._drop(i)
        return len(ids)


def check_arrays(arrays: dict, expected: dict[str, tuple], ntokens: int) -> None:
    """Raise CorruptEntry unless ``arrays`` has exactly the names/shapes/dtypes expected.

    ``expected[name] = (shape, dtype)`` where a ``-1`` in shape stands for ``ntokens``.
    Names absent from ``arrays`` are allowed only if the whole leaf part is optional, which
    the caller expresses by leaving them out of ``expected``.
    """
    for name, (shape, dtype) in expected.items():
        a = arrays.get(name)
        if a is None:
            raise CorruptEntry(f"missing tensor {name}")
        want = tuple(ntokens if s == -1 else s for s in shape)
        if tuple(a.shape) != want or a.dtype != dtype:
            raise CorruptEntry(
                f"tensor {name}: {tuple(a.shape)} {a.dtype}, expected {want} {dtype}"
            )
