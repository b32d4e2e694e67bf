"""Publishing a directory built in steps (model conversions, tiny and shape models), and
cleaning up after builds that were killed.

Every temp entry a build makes beside its target is hidden and carries the builder's pid:
``.<name>.tmp-<pid>-<random>`` (a directory from :func:`staged_dir`, a file from
:func:`temp_file`). A build killed at any point (SIGKILL, a power cut) leaves it behind;
:func:`remove_stale_temps` removes those whose process is gone, so the next start never
deletes what a live process is still writing. Readers (the model picker) skip hidden
entries, so a half-built directory is never offered as a model.

Small JSON files that another process reads (the live status file, clear requests, the SSD
tier's write ledger and model file) are replaced whole: :func:`write_atomic`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[^/]+$")
"""A temp entry of this module: ``.<name>.tmp-<pid>-<random>[.suffix]``."""

_LEGACY_TEMP = re.compile(r"^\.(?:.+\.tmp-[a-z0-9_]{8}|[^.]+-[a-z0-9_]{8}\.gguf)$")
"""Temp names of builds before the pid was in the name (``.demo.tmp-k3j2h1g0``,
``.demo-k3j2h1g0.gguf``): no owner to ask, so they go by age."""

LEGACY_TEMP_AGE_S = 3600.0
"""A temp entry without a pid is stale when untouched this long (s); a conversion writes
to it at least every few seconds."""


def temp_prefix(name: str) -> str:
    """The prefix of this process's temp entries for a build of ``name``."""
    return f".{name}.tmp-{os.getpid()}-"


@contextlib.contextmanager
def temp_file(target: Path, suffix: str = "") -> Iterator[Path]:
    """A new empty temp file beside ``target`` (named as the module docstring says),
    removed when the block ends, whatever happens in it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=temp_prefix(target.name), suffix=suffix, dir=target.parent)
    os.close(fd)
    path = Path(name)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_dir(target: Path, done: Callable[[Path], bool]) -> Iterator[Path]:
    """A new temp dir beside ``target`` (mode 0755) to build into; renamed to ``target``
    when the block ends without an error, so readers never see a half-built directory.

    ``done(target)`` says whether ``target`` is already complete: then another process
    finished the same build first and its copy is kept. An incomplete ``target`` (left by
    a crash) is replaced. The check and the rename run under a lock on the parent folder,
    so builders of one target in parallel processes never remove each other's complete
    copy while it is read. The temp dir is removed in every case but a killed process;
    :func:`remove_stale_temps` removes it then.

    Raises:
        OSError: the temp dir cannot be made, or the rename fails and ``target`` is still
            not complete.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(target.name), dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700
    try:
        yield tmp
        with _folder_lock(target.parent):  # no complete target is removed under a reader
            if not done(target):
                shutil.rmtree(target, ignore_errors=True)
                try:
                    os.rename(tmp, target)
                except OSError:  # another process won the race (unlocked: no fcntl)
                    if not done(target):
                        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder`` itself (no lock file to leave behind) while the
    block runs: builders of one target in several processes (parallel test workers, two
    starts of the app) publish one at a time, so the check that ``target`` is complete
    and the removal of an incomplete one cannot interleave with another's rename. Where
    ``fcntl`` is missing (Windows) the block runs unlocked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts). ``pid <= 0`` is never alive
    (``os.kill(0, 0)`` would signal our own process group); on Windows, where
    ``os.kill(pid, 0)`` would send CTRL_C_EVENT, every pid is taken as alive."""
    if pid <= 0:
        return False
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return False
    return True


def private_dirs(path: Path, *, tighten: bool = False) -> None:
    """Create directory ``path`` and its missing parents, each 0700 (``mkdir(parents=True)``
    would make the parents 0777 minus the umask). ``tighten``: an existing ``path`` that
    group or others may read is made 0700 too.

    Raises:
        OSError: a part cannot be created (read-only, full disk, a file in the way).
    """
    missing, p = [], Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)
    if tighten and Path(path).stat().st_mode & 0o077:
        Path(path).chmod(0o700)


def private_open(path: Path, flags: int):
    """A text file opened with ``os.open`` ``flags`` (``O_APPEND``: for appending, else for
    writing), created 0600 and tightened to 0600 if it was not; ``O_NOFOLLOW``: never
    through a link (where the platform has it).

    Raises:
        OSError: it cannot be opened (a link in the way: ``ELOOP``).
    """
    fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return open(fd, "a" if flags & os.O_APPEND else "w", encoding="utf-8")  # noqa: SIM115


def _last_write(path: Path) -> float:
    """The newest mtime of ``path`` and, for a directory, its entries (a file being
    written inside a directory does not touch the directory's own mtime)."""
    times = [path.lstat().st_mtime]
    if path.is_dir() and not path.is_symlink():
        times += [child.lstat().st_mtime for child in path.iterdir()]
    return max(times)


def remove_stale_temps(folder: Path, *, now: float | None = None) -> list[Path]:
    """Remove the temp entries in ``folder`` (not below it) that no live process writes:
    those whose pid is not running, and pid-less ones (older builds) untouched for
    :data:`LEGACY_TEMP_AGE_S`. Returns what was removed; never raises (a folder that
    cannot be listed, an entry that cannot be removed, are left as they are).

    A pid reused by an unrelated process keeps its entry until that process ends (a
    leftover, never a deletion under a live build).
    """
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for path in entries:
        match = _TEMP.match(path.name)
        try:
            if match is not None:
                stale = not pid_alive(int(match["pid"]))
            elif _LEGACY_TEMP.match(path.name):
                stale = now - _last_write(path) > LEGACY_TEMP_AGE_S
            else:
                continue
            if not stale:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` (0600; a new folder 0700) so a reader sees the old
    file or the new one."""
    private_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
