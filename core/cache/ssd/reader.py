"""The SSD tier's reads (docs/DESIGN.md §8.4): a load of one entry on the engine thread,
and the reads ahead of it on worker threads.

A pending entry (accepted, not yet on disk) comes from memory. Otherwise its file is read
whole into staging arrays (:func:`~.io.read_file`), both CRCs checked again, its header
compared with the index, and its tensors viewed in place. A checksum or format failure
makes the entry *corrupt*; a file found missing is forgotten; a resource error (EMFILE,
ENFILE, ENOMEM, EACCES, EIO...: an ``OSError`` other than a missing file) is not
corruption: the load is a miss, counted in ``errors`` and logged, and the file stays for a
later retry. The reader threads of a restore write file bytes into the memory of staging
arrays the engine made (:func:`~.io.staging`), plain file I/O and CRC-32 with no MLX. On
CUDA the reader threads only verify, and the load reads the verified file again with
``mx.load``, which copies it to device memory without managed memory's page faults
(:func:`~.io.loads_by_path`, :func:`~.io.load_verified`).

:class:`SSDReader` is a collaborator of :class:`~.tier.SSDTier`, given its lock, index,
writer and file paths, and what to call for a hit, a corrupt or missing file and an error.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..blocks import Entry, EntryMeta
from .format import CorruptEntry, check_arrays, entry_meta
from .index import EntryIndex
from .io import (
    ReadAhead,
    advise_willneed,
    arrays_in,
    fits_one_load,
    load_verified,
    loads_by_path,
    read_file,
    staging,
    views_of,
)
from .writer import SSDWriter


class SSDReader:
    """Loads and reads ahead for one SSD tier (see the module doc). ``lock`` guards
    ``index`` and the ``writer``'s pending entries; ``path_of(id)``: an entry's file;
    ``fingerprint``: the model's, checked in each header. ``counted(from_memory)``: a
    load served (from a pending entry's arrays or from its file); ``condemn(id, reason,
    ino)``: a corrupt file read; ``forget(id)``: a file found missing;
    ``count_error(text)``: any other failure. ``by_path``: verify a file with a read of
    its own, then load it with ``mx.load`` (:func:`~.io.loads_by_path`: on CUDA), instead
    of viewing the staging arrays it was read into."""

    by_path: bool = loads_by_path()

    def __init__(
        self,
        *,
        lock: threading.Lock,
        index: EntryIndex,
        writer: SSDWriter,
        path_of: Callable[[str], Path],
        fingerprint: str,
        counted: Callable[[bool], None],
        condemn: Callable[..., None],
        forget: Callable[[str], None],
        count_error: Callable[[str], None],
    ) -> None:
        self.lock, self.index, self.writer, self.path_of = lock, index, writer, path_of
        self.fingerprint = fingerprint
        self.counted, self.condemn, self.forget = counted, condemn, forget
        self.count_error = count_error
        self.ahead = ReadAhead()  # files read ahead of their load (pure I/O and CRC)

    def close(self) -> None:
        """Stop the reads ahead (their worker threads)."""
        self.ahead.close()

    def load(self, entry_id: str, expected: dict[str, tuple] | None = None) -> Entry | None:
        """One entry's arrays as MLX arrays (engine thread), or None.

        A pending entry comes from memory (the arrays ``put`` was given); otherwise the
        file is read whole into staging arrays (:func:`read_file`), both CRCs checked,
        its header compared with the index, and its tensors viewed in place
        (:func:`arrays_in`). ``expected`` maps names to ``(shape, dtype)`` with
        ``-1`` for the token axis (:func:`check_arrays`). A checksum, format or shape
        failure: counted corrupt, logged, removed, None. A missing file: forgotten, None.
        Any other failure (EMFILE, ENOMEM, an MLX error): counted in ``errors``, logged,
        the file kept for a later load, None.
        """
        with self.lock:
            meta = self.index.get(entry_id)
            if meta is None:
                return None
            item = self.writer.pending.get(entry_id)
            meta = replace(meta, atime=time.time())
            self.index.touch(meta)  # most recently used
        ino = None
        try:
            if item is not None:
                arrays = dict(item.entry.arrays)
            else:
                path = self.path_of(entry_id)
                ahead = self.ahead.take(entry_id)
                if ahead is None:
                    stages = None if self.by_path else staging(meta.nbytes)
                    into = None if stages is None else views_of(stages)
                    layout, _, ino = read_file(path, keep=stages is not None, into=into)
                else:
                    stages, read = ahead
                    layout, _, ino = read.result()
                if EntryMeta.meta(entry_meta(layout.meta, self.fingerprint)) != meta.meta():
                    raise CorruptEntry("file changed since indexed")
                if stages is not None:
                    arrays = arrays_in(layout, stages)
                elif fits_one_load(layout):
                    arrays = load_verified(path, layout, ino, meta.nbytes)
                else:  # a tensor over MLX's bound: read again, into staging pieces
                    stages = staging(meta.nbytes)
                    layout, _, ino = read_file(path, into=views_of(stages))
                    arrays = arrays_in(layout, stages)
            if expected is not None:
                check_arrays(arrays, expected, len(meta.tokens))
        except CorruptEntry as exc:
            self.condemn(entry_id, str(exc))
            return None
        except FileNotFoundError:
            self.forget(entry_id)
            return None
        except Exception as exc:  # EMFILE, ENOMEM, an MLX error...: a miss, file kept
            text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.count_error(f"cannot read {entry_id[:12]} ({text or type(exc).__name__}); kept")
            return None
        if item is None:
            try:
                os.utime(self.path_of(entry_id), (meta.atime, meta.atime))
            except OSError:
                pass
        self.counted(item is not None)
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
            with self.lock:
                meta = self.index.get(entry_id)
                if entry_id in self.writer.pending or meta is None or entry_id in self.ahead:
                    continue
            self.ahead.start(entry_id, self.path_of(entry_id), meta.nbytes, self.by_path)

    def drop_reads(self) -> None:
        """Forget reads ahead that no load took (the restore changed its plan)."""
        self.ahead.drop()

    def prefetch(self, entry_ids) -> None:
        """Ask the kernel to start reading these entries' files now (``POSIX_FADV_WILLNEED``,
        asynchronous; a no-op where unsupported or for pending entries), so the loads of a
        long restore overlap their reads with each other's checks and copies."""
        with self.lock:
            ids = [i for i in entry_ids if i in self.index and i not in self.writer.pending]
        advise_willneed(self.path_of(i) for i in ids)
