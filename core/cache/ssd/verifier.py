"""What the SSD tier checks of its files at start (docs/DESIGN.md §8.4): the scan that
rebuilds the index from headers (:func:`scan_entries`), and the background verifier that
then reads every file found once and checks its data CRC (:class:`StartupVerifier`).

The scan checks each header (length, hcrc, fields, id hash) and the file's name against
the entry's id. It takes regular files only (``lstat``), never follows a symbolic link,
never opens a FIFO or a device, and removes a ``.tmp`` file only when its writer is gone
(the PID in its name) or it is older than :data:`STALE_TMP_S`. A checksum or format
failure makes an entry *corrupt*: counted, logged with the reason, removed when possible.
A resource error (EMFILE, EACCES, EIO...) is not corruption: counted in ``errors``, the
file kept for the next start. What the checks find goes to the tier's :class:`Findings`.
Later, the tier compares its index with a listing of the folder (:func:`entry_file_names`,
:meth:`.tier.SSDTier.reconcile`).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ...files import pid_alive
from .format import CorruptEntry, FileMeta, entry_meta, parse_header
from .io import _inode, _open_regular, _read_head, read_file

STALE_TMP_S = 600.0  # a .tmp file this old is removed even when its writer may live


class Findings(Protocol):
    """How the tier counts and logs what a check finds."""

    def corrupt_file(self, path: Path, reason: str, remove: bool) -> None:
        """A corrupt entry's file: counted and logged; removed when ``remove``."""

    def count_error(self, text: str) -> None:
        """A resource error (the file is kept): counted in ``errors`` and logged."""

    def remove_file(self, path: Path) -> None:
        """Remove ``path`` (a failure counted, never raised)."""


class Verified(Findings, Protocol):
    """What the start-up verifier asks of the tier."""

    def written_file(self, entry_id: str) -> Path | None:
        """The file of a held entry that is on disk; None when pending or not held."""

    def forget(self, entry_id: str) -> None:
        """Drop an entry whose file is gone (not corrupt: someone removed it)."""

    def condemn(self, entry_id: str, reason: str, ino: int | None = None) -> None:
        """Count and drop a corrupt entry, unless its file changed since (``ino``)."""


def scan_entries(directory: Path, fingerprint: str, findings: Findings) -> list[FileMeta]:
    """The entries of ``directory`` (``<id[:2]>/<id>.safetensors`` below it) whose headers
    check out for ``fingerprint``, least recently used first (by mtime, then id). Raises
    OSError only if ``directory`` cannot be listed; any single bad path goes to
    ``findings`` and is skipped."""
    found: list[FileMeta] = []
    with os.scandir(directory) as it:
        shards = list(it)
    for shard in shards:
        try:
            if shard.is_symlink():
                findings.corrupt_file(Path(shard.path), "symbolic link in the cache dir", True)
                continue
            if not shard.is_dir(follow_symlinks=False):
                continue
            with os.scandir(shard.path) as it:
                entries = list(it)
        except OSError as exc:
            findings.count_error(f"cannot read {shard.path}: {exc.strerror or exc}")
            continue
        for ent in entries:
            try:
                meta = _scan_one(ent, fingerprint, findings)
            except Exception as exc:  # the scan survives any single bad path
                findings.corrupt_file(Path(ent.path), str(exc) or type(exc).__name__, False)
                continue
            if meta is not None:
                found.append(meta)
    return sorted(found, key=lambda m: (m.atime, m.id))


def _scan_one(ent: os.DirEntry, fingerprint: str, findings: Findings) -> FileMeta | None:
    path = Path(ent.path)
    st = ent.stat(follow_symlinks=False)
    if ent.name.endswith(".tmp"):
        _sweep_tmp(path, st, findings)
        return None
    if not ent.name.endswith(".safetensors"):
        return None
    if not stat.S_ISREG(st.st_mode):
        # a link, FIFO, socket or device is removed (unlink never follows); a
        # directory is left alone; nothing is opened
        findings.corrupt_file(path, "not a regular file", not stat.S_ISDIR(st.st_mode))
        return None
    try:
        f, st = _open_regular(path)
        with f:
            layout = parse_header(_read_head(f, st.st_size), st.st_size)
        m = entry_meta(layout.meta, fingerprint)
        if m.id + ".safetensors" != ent.name or m.id[:2] != path.parent.name:
            raise CorruptEntry("id does not match file name")
    except CorruptEntry as exc:
        findings.corrupt_file(path, str(exc), True)
        return None
    except FileNotFoundError:
        return None  # removed since listed
    except OSError as exc:  # EMFILE, EACCES, EIO...: kept for the next start
        findings.count_error(f"cannot read {path.name[:12]} ({exc.strerror or exc}); kept")
        return None
    return FileMeta(**m.meta(), nbytes=st.st_size, atime=st.st_mtime)


def _sweep_tmp(path: Path, st: os.stat_result, findings: Findings) -> None:
    """Remove a temp file whose writer is gone or that is older than STALE_TMP_S."""
    if stat.S_ISDIR(st.st_mode):
        return
    parts = path.name.split(".")
    pid = int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None
    stale = time.time() - st.st_mtime > STALE_TMP_S
    if stale or (pid is not None and pid != os.getpid() and not pid_alive(pid)):
        findings.remove_file(path)


class StartupVerifier:
    """A thread that reads the files of the entries ``ids`` found at start once each and
    checks both CRCs (:func:`~.io.read_file`): a corrupt file is condemned, a missing one
    forgotten, a resource error counted with the file kept, unverified; an entry pending
    or gone since is skipped. Between files it waits while ``wait_unheld()`` says disk
    work is held (a request's TTFT comes first); it ends early when that returns False
    (the tier is closing). :meth:`wait` returns once every file was read (or the thread
    ended)."""

    def __init__(self, ids: list[str], tier: Verified, wait_unheld: Callable[[], bool]) -> None:
        self._ids = ids
        self._tier = tier
        self._wait_unheld = wait_unheld
        self.done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tierchat-ssd-verifier", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every file found at start was read, waiting at most ``timeout`` s."""
        return self.done.wait(timeout)

    def join(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        try:
            for entry_id in self._ids:
                if not self._wait_unheld():
                    return
                self._verify(entry_id)
        finally:
            self.done.set()

    def _verify(self, entry_id: str) -> None:
        path = self._tier.written_file(entry_id)
        if path is None:
            return
        try:
            read_file(path, keep=False)
        except FileNotFoundError:
            self._tier.forget(entry_id)
        except CorruptEntry as exc:
            ino = _inode(path)
            if ino is not None:
                self._tier.condemn(entry_id, str(exc), ino)
        except OSError as exc:  # a resource error: the file stays, unverified
            self._tier.count_error(f"cannot verify {entry_id[:12]} ({exc.strerror or exc})")


def entry_file_names(directory: Path) -> set[str] | None:
    """The names of the files in ``directory``'s entry folders (one ``scandir`` of it and
    one listing per folder, no file read or ``stat``): an empty set when it is missing,
    None when it cannot be listed for another reason (the check is skipped)."""
    names: set[str] = set()
    try:
        with os.scandir(directory) as it:
            shards = [d.path for d in it if d.is_dir(follow_symlinks=False)]
        for shard in shards:
            try:
                names.update(os.listdir(shard))
            except FileNotFoundError:
                pass
    except FileNotFoundError:
        pass
    except OSError:
        return None
    return names
