"""A running engine's cache figures on disk, and clear requests to it. Pure Python.

One process owns a cache dir (the SSD tier's lock, :func:`~tierchat.core.cache.ssd.tier.
acquire_dir`). Its hot tier, tails and counters live in that process; ``tierchat cache
stats`` in another shell would otherwise load the model and show a fresh process's zeros,
and its ``cache clear`` would delete SSD files under the running engine. So every process
that runs an engine (the TUI, ``tierchat serve``, ``chat`` and ``replay``) writes a small
status file in the cache directory and picks up clear requests there:

- ``<cache_dir>/live-status.json``: ``{"version", "pid", "process", "model",
  "written_at", "stats", "clears"}``, written atomically (temp file + ``os.replace``,
  0600). ``stats`` is the :class:`~tierchat.core.api.CacheStats` snapshot as plain JSON;
  ``clears`` the last few clear requests served, ``{"id", "tier", "report"}``.
- ``<cache_dir>/live-requests/clear-<id>.json``: ``{"id", "tier"}``, written atomically by
  ``tierchat cache clear``; the owner clears the tier on its next poll (through its own
  engine, so its panels and index stay right), deletes the file and lists the id in
  ``clears``.

The TUI writes from its stats poll (:class:`StatusWriter`); the other commands run a
:class:`StatusService` thread. A status file whose pid is not alive is stale and ignored.
Every clear, asked for here or in the owner's own UI, goes through :func:`clear_tier` and
is answered with its one :func:`clear_report`.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from .api import CACHE_TIERS, CacheStats, EngineLike, plain
from .files import pid_alive, write_atomic
from .units import fmt_bytes

STATUS_FILE = "live-status.json"
REQUESTS_DIR = "live-requests"
FORMAT_VERSION = 2
KEEP_CLEARS = 8


class StatusWriter:
    """The owner's side: :meth:`write` the status on every poll, :meth:`requests` to read
    the clear requests waiting, :meth:`served` once one is done. ``process`` names the
    command for the CLI's messages ("TUI", "serve", "chat", "replay")."""

    def __init__(self, cache_dir: Path, *, pid: int | None = None, process: str = "TUI") -> None:
        self.cache_dir = Path(cache_dir)
        self.path = self.cache_dir / STATUS_FILE
        self.pid = os.getpid() if pid is None else pid
        self.process = process
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
        data = {
            "version": FORMAT_VERSION,
            "pid": self.pid,
            "process": self.process,
            "written_at": time.time(),
            **body,
        }
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
    """The status of the process running an engine on ``cache_dir``, or None (no file,
    unreadable, or its process is gone)."""
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
    """Ask the process running on ``cache_dir`` to clear ``tier``; returns the request id."""
    rid = uuid.uuid4().hex[:12]
    write_atomic(Path(cache_dir) / REQUESTS_DIR / f"clear-{rid}.json", {"id": rid, "tier": tier})
    return rid


def wait_cleared(
    cache_dir: Path, rid: str, timeout_s: float = 5.0, poll_s: float = 0.05
) -> dict[str, Any] | None:
    """The owner's record of request ``rid`` once served, or None after ``timeout_s`` (the
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


def check_tier(tier: str) -> None:
    """Raises ``ValueError`` (in the words every process answers) unless ``tier`` is one
    of :data:`~tierchat.core.api.CACHE_TIERS`."""
    if tier not in CACHE_TIERS:
        raise ValueError(f"unknown tier {tier!r}: expected one of {', '.join(CACHE_TIERS)}")


def clear_report(tier: str, before: CacheStats | None, after: CacheStats | None) -> str:
    """What a clear of ``tier`` removed from *each* tier, measured from the snapshots
    (a tier the clear also touched is reported too, e.g. checkpoint files on the SSD, and
    the resident cache a clear of RAM drops)."""
    if before is None or after is None:
        return f"Cleared {tier}."
    parts = []
    rows = (
        ("hot", before.hot.entries - after.hot.entries, before.hot.nbytes - after.hot.nbytes),
        ("SSD", before.ssd.entries - after.ssd.entries, before.ssd.nbytes - after.ssd.nbytes),
        (
            "tails",
            before.tails.entries - after.tails.entries,
            before.tails.nbytes - after.tails.nbytes,
        ),
    )
    for name, n, nbytes in rows:
        if n > 0 or nbytes > 0:
            parts.append(f"{name} −{n} ({fmt_bytes(max(nbytes, 0))})")
    ckpt = before.tails.checkpoints - after.tails.checkpoints
    if ckpt > 0:
        parts.append(f"checkpoints −{ckpt}")
    # the resident cache (the last request's live cache, in RAM beside the hot tier's
    # entries) goes with a clear of RAM: a clear that dropped only it was not a no-op
    tokens = before.resident.tokens - after.resident.tokens
    if tokens > 0:
        freed = max(before.resident.nbytes - after.resident.nbytes, 0)
        parts.append(f"resident cache −{tokens} tokens ({fmt_bytes(freed)})")
    if not parts:
        return f"Cleared {tier}: it was already empty."
    return f"Cleared {tier}: " + " · ".join(parts) + "."


def clear_tier(engine: EngineLike, tier: str) -> str:
    """Clear ``tier`` through ``engine`` (on its thread, between decode steps) and return
    the :func:`clear_report`: the one clear of every process (the TUI's keys, a clear
    request to a running ``serve``, ``chat`` or ``replay``, ``tierchat cache clear`` in
    its own process), so ``cache clear`` answers in the same words wherever it runs.

    Raises:
        ValueError: ``tier`` is unknown (:func:`check_tier`); nothing is cleared.
        Exception: what ``engine.clear`` raises.
    """
    check_tier(tier)
    before = _stats(engine)
    engine.clear(tier)
    return clear_report(tier, before, _stats(engine))


def _stats(engine: EngineLike) -> CacheStats | None:
    try:
        return engine.stats()
    except Exception:  # noqa: BLE001 - the report then says less, the clear still runs
        return None


def failure_report(error: Exception) -> str:
    """The answer to a clear request that failed (``"failed: ..."``, which
    ``tierchat cache clear`` turns into exit status 1)."""
    return f"failed: {str(error) or type(error).__name__}"


class StatusService:
    """The status/clear protocol for a process without a UI poll (``serve``, ``chat``,
    ``replay``): a thread that every ``poll_s`` seconds writes ``engine``'s stats to the
    status file and serves clear requests through ``engine.clear`` (which runs on the
    engine thread, between decode steps). ``engine`` may be swapped (replay's restart)
    or None (no engine for now). :meth:`stop` removes the status file."""

    def __init__(self, engine: Any, cache_dir: Path, process: str, poll_s: float = 0.5) -> None:
        self.engine = engine
        self.writer = StatusWriter(Path(cache_dir), process=process)
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=f"tierchat-status-{process}", daemon=True
        )

    def start(self) -> StatusService:
        self.poll()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Write the status once and serve the clear requests waiting. Never raises."""
        engine = self.engine
        if engine is None:
            return
        try:
            stats = engine.stats()
            self.writer.write(engine.model_name, stats)
            for request in self.writer.requests():
                self._serve(engine, request)
        except Exception:  # noqa: BLE001 -- a closed engine: try again next poll
            return

    def _serve(self, engine: Any, request: dict[str, Any]) -> None:
        try:
            report = clear_tier(engine, request["tier"])
        except Exception as e:  # noqa: BLE001 -- answered, not raised
            report = failure_report(e)
        self.writer.served(request, report)
        self.writer.write(engine.model_name, engine.stats())

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.writer.remove()

    def __enter__(self) -> StatusService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def owner_message(cache_dir: Path) -> str | None:
    """Why a new engine process must not use ``cache_dir``: another process holds its lock
    (:func:`~tierchat.core.cache.dir_lock.dir_owner`); None when it is free.
    """
    owner = _dir_owner(Path(cache_dir))
    if owner is None:
        return None
    live = read_status(cache_dir)
    if live is not None and live.get("process"):
        who = f"tierchat {live['process']}"
    else:
        who = owner.get("command") or "tierchat"
    pid = owner.get("pid", "?")
    return (
        f"the cache dir {cache_dir} is in use by {who} (pid {pid}); one "
        "process owns a cache dir. `tierchat cache stats` and `tierchat cache clear` talk "
        "to it; stop it first, or use another --cache-dir (or --no-cache)"
    )


def _dir_owner(cache_dir: Path) -> dict[str, Any] | None:
    from .cache.dir_lock import dir_owner

    return dir_owner(cache_dir)
