"""One owner per cache dir: an exclusive ``fcntl.flock`` on ``<cache_dir>/lock``.

Two processes on one cache dir desync each other (docs/DESIGN.md §8.4): one's eviction
deletes the other's files, one's ``cache clear`` empties the other's tier under its index.
The SSD tier takes this lock when it opens a dir and turns itself off when another
process holds it; ``tierchat chat``, ``serve`` and ``replay`` refuse to start on a dir
another process owns, and ``tierchat cache`` talks to the owner instead
(:mod:`tierchat.core.live_status`). The lock file holds the owner's pid and command, for
the messages. flock locks go with the process: a killed owner leaves no stale lock.
Pure Python: no MLX.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from pathlib import Path

LOCK_FILE = "lock"  # <cache_dir>/lock, 0600


class CacheDirBusy(Exception):
    """Another process holds a cache dir's lock; ``owner`` is what it wrote there
    (``{"pid", "command"}``, possibly empty)."""

    def __init__(self, cache_dir: Path, owner: dict) -> None:
        self.cache_dir = Path(cache_dir)
        self.owner = owner
        pid, command = owner.get("pid", "?"), owner.get("command") or "tierchat"
        super().__init__(f"cache dir {cache_dir} is in use by {command} (pid {pid})")


_held: dict[str, list[int]] = {}  # realpath of a cache dir -> [lock fd, engines using it]
_held_lock = threading.Lock()


def _lock_key(cache_dir: Path) -> str:
    return os.path.realpath(cache_dir)


def _read_owner(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        owner = json.loads(raw.decode() or "{}")
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def acquire_dir(cache_dir: Path, command: str = "") -> None:
    """Take ``<cache_dir>/lock`` for this process (``flock(LOCK_EX | LOCK_NB)``, the file
    0600, holding this pid and ``command``). Engines of one process share it: each
    :func:`acquire_dir` needs one :func:`release_dir`. Where ``fcntl`` does not exist
    (Windows) nothing is locked.

    Raises:
        CacheDirBusy: another process holds it.
        OSError: the lock file cannot be created.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return
    key = _lock_key(cache_dir)
    with _held_lock:
        held = _held.get(key)
        if held is not None:
            held[1] += 1
            return
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
        fd = os.open(Path(cache_dir) / LOCK_FILE, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            owner = _read_owner(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CacheDirBusy(Path(cache_dir), owner) from None
            raise
        info = json.dumps({"pid": os.getpid(), "command": command or _command()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        _held[key] = [fd, 1]


def release_dir(cache_dir: Path) -> None:
    """Give back one :func:`acquire_dir`; the last one unlocks and closes the file."""
    key = _lock_key(cache_dir)
    with _held_lock:
        held = _held.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del _held[key]
            try:
                os.ftruncate(held[0], 0)
            except OSError:
                pass
            os.close(held[0])  # closing the last descriptor releases the flock


def relock_dir(cache_dir: Path) -> None:
    """Lock ``<cache_dir>/lock`` again after the file was removed with its dir (the old
    descriptor locks a file nobody else can see), keeping this process's count.

    Raises:
        CacheDirBusy: another process took the new file first.
        OSError: it cannot be created.
    """
    with _held_lock:
        held = _held.pop(_lock_key(cache_dir), None)
    if held is None:
        return
    os.close(held[0])
    acquire_dir(cache_dir)
    with _held_lock:
        _held[_lock_key(cache_dir)][1] = held[1]


def dir_owner(cache_dir: Path) -> dict | None:
    """Who holds ``<cache_dir>/lock``: ``{"pid", "command"}`` of another process, or None
    (nobody, this process, no lock file, or no ``fcntl``)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    with _held_lock:
        if _lock_key(cache_dir) in _held:
            return None
    try:
        fd = os.open(Path(cache_dir) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _read_owner(fd) or {"pid": "?"}
    finally:
        os.close(fd)  # also drops the shared lock if it was taken
    return None


def _command() -> str:
    """``tierchat <verb>`` for the tierchat entry point, else the program's name."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    if name not in ("tierchat", "main.py", "__main__.py"):
        return name
    verb = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else ""
    return f"tierchat {verb}".strip()
