"""The running TUI's cache figures on disk, and clear requests to it. Pure Python.

The hot tier, tails and counters live in one process; ``tierchat cache stats`` in another
shell would otherwise load the model and show a fresh process's zeros, and its ``cache
clear`` would delete SSD files under the running app. So the TUI writes a small status
file in the cache directory on every stats poll, and picks up clear requests there:

- ``<cache_dir>/tui-status.json``: ``{"version", "pid", "model", "written_at", "stats",
  "clears"}``, written atomically (temp file + ``os.replace``). ``stats`` is the
  :class:`~tierchat.core.api.CacheStats` snapshot as plain JSON; ``clears`` the last
  few clear requests the app served, ``{"id", "tier", "report"}``.
- ``<cache_dir>/tui-requests/clear-<id>.json``: ``{"id", "tier"}``, written atomically by
  ``tierchat cache clear``; the app clears the tier on its next poll (through its own
  engine, so its panels stay right), deletes the file and lists the id in ``clears``.

A status file whose pid is not alive is stale and ignored.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tierchat.core.api import plain

STATUS_FILE = "tui-status.json"
REQUESTS_DIR = "tui-requests"
FORMAT_VERSION = 1
KEEP_CLEARS = 8


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` so a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
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


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    except OSError:
        return False
    return True


class StatusWriter:
    """The app side: :meth:`write` the status on every poll, :meth:`requests` to read the
    clear requests waiting, :meth:`served` once one is done."""

    def __init__(self, cache_dir: Path, *, pid: int | None = None) -> None:
        self.cache_dir = Path(cache_dir)
        self.path = self.cache_dir / STATUS_FILE
        self.pid = os.getpid() if pid is None else pid
        self.clears: list[dict[str, Any]] = []
        self._last: str = ""
        self.error: str = ""

    def write(self, model: str, stats: Any) -> bool:
        """Write the snapshot if it changed; never raises (returns False and keeps the
        error in ``error`` when the directory is not writable)."""
        body = {"model": model, "stats": plain(stats), "clears": self.clears}
        text = json.dumps(body, sort_keys=True)
        if text == self._last:
            return True
        data = {"version": FORMAT_VERSION, "pid": self.pid, "written_at": time.time(), **body}
        try:
            write_atomic(self.path, data)
        except OSError as e:
            self.error = str(e)
            return False
        self._last = text
        return True

    def requests(self) -> list[dict[str, Any]]:
        """Clear requests waiting, oldest first; unreadable ones are removed."""
        folder = self.cache_dir / REQUESTS_DIR
        try:
            files = sorted(folder.glob("clear-*.json"), key=lambda p: p.stat().st_mtime)
        except OSError:
            return []
        out = []
        for path in files:
            try:
                data = json.loads(path.read_text())
                tier = str(data["tier"])
                rid = str(data["id"])
            except (OSError, ValueError, KeyError, TypeError):
                _unlink(path)
                continue
            out.append({"id": rid, "tier": tier, "path": str(path)})
        return out

    def served(self, request: dict[str, Any], report: str) -> None:
        _unlink(Path(request["path"]))
        self.clears.append({"id": request["id"], "tier": request["tier"], "report": report})
        del self.clears[:-KEEP_CLEARS]

    def remove(self) -> None:
        """Drop the status file at exit (only if it is ours)."""
        live = read_status(self.cache_dir, check_pid=False)
        if live is not None and live.get("pid") == self.pid:
            _unlink(self.path)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def read_status(cache_dir: Path, *, check_pid: bool = True) -> dict[str, Any] | None:
    """The status of a TUI running on ``cache_dir``, or None (no file, unreadable, or its
    process is gone)."""
    try:
        data = json.loads((Path(cache_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        return None
    if check_pid and not pid_alive(int(data.get("pid", 0))):
        return None
    return data


def request_clear(cache_dir: Path, tier: str) -> str:
    """Ask the running TUI to clear ``tier``; returns the request id."""
    rid = uuid.uuid4().hex[:12]
    write_atomic(Path(cache_dir) / REQUESTS_DIR / f"clear-{rid}.json", {"id": rid, "tier": tier})
    return rid


def wait_cleared(
    cache_dir: Path, rid: str, timeout_s: float = 5.0, poll_s: float = 0.05
) -> dict[str, Any] | None:
    """The app's record of request ``rid`` once served, or None after ``timeout_s`` (the
    request file is then withdrawn)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = read_status(cache_dir)
        for item in (status or {}).get("clears", []):
            if item.get("id") == rid:
                return item
        if time.monotonic() > deadline or status is None:
            _unlink(Path(cache_dir) / REQUESTS_DIR / f"clear-{rid}.json")
            return None
        time.sleep(poll_s)
