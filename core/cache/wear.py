"""Bytes the SSD tier writes: counted per session and in total, budgeted per 24 hours.

Disk-backed KV caches wear SSDs (docs/DESIGN.md §8.6): a cache that writes every block of
every turn writes several times the K/V it will ever read back. The :class:`WriteLedger`
keeps what has been written to one cache dir, across sessions, in one small JSON file
beside the model folders (``<cache_dir>/ssd-writes.json``), and answers whether a write fits
the budget ``ssd_write_budget``: at most that many bytes in any 24 hours.

The 24 hours are counted in whole hours: the bytes of the current hour and of the 24 before
it (a superset of the last 24 hours, so the bound holds for every window of 24 hours).
Hours older than that are forgotten. The clock is injected for tests.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..files import write_atomic

HOUR_S = 3600
WINDOW_HOURS = 25  # the current hour and the 24 before it
SAVE_EVERY_S = 30.0  # the ledger file is rewritten at most this often (and at close)


class WriteLedger:
    """SSD bytes written to one cache dir: ``total_bytes`` and ``total_files`` over every
    session, ``session_bytes`` and ``session_files`` since this ledger was opened, and
    bytes per hour for the budget.

    ``path``: the JSON file (None: in memory only); ``budget``: bytes allowed in any 24
    hours (0: no budget); ``clock``: seconds since the epoch. Thread-safe: the SSD
    writer records, the engine thread asks.
    """

    def __init__(
        self,
        path: Path | None,
        budget: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.budget = max(0, int(budget))
        self.clock = clock
        self._lock = threading.Lock()
        self.total_bytes = self.total_files = 0
        self.session_bytes = self.session_files = 0
        self._hours: dict[int, int] = {}  # hour index (epoch hours) -> bytes written
        self._saved_at = 0.0
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            raw = json.loads(path.read_text())
            self.total_bytes = max(0, int(raw.get("total_bytes", 0)))
            self.total_files = max(0, int(raw.get("total_files", 0)))
            hours = {int(h): max(0, int(n)) for h, n in dict(raw.get("hours", {})).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return  # missing or unreadable: counted from zero
        now = self._hour()
        self._hours = {h: n for h, n in hours.items() if now - WINDOW_HOURS < h <= now}

    def _hour(self) -> int:
        return int(self.clock() // HOUR_S)

    def day_bytes(self) -> int:
        """Bytes written in the current hour and the 24 before it."""
        now = self._hour()
        with self._lock:
            return sum(n for h, n in self._hours.items() if now - WINDOW_HOURS < h <= now)

    def room(self, pending: int = 0) -> int | None:
        """Bytes that may still be written in the window, after ``pending`` bytes already
        accepted and not yet written; None when there is no budget."""
        if not self.budget:
            return None
        return max(0, self.budget - self.day_bytes() - pending)

    def record(self, nbytes: int) -> None:
        """``nbytes`` were written as one file (writer thread)."""
        now = self._hour()
        with self._lock:
            self.total_bytes += nbytes
            self.total_files += 1
            self.session_bytes += nbytes
            self.session_files += 1
            self._hours[now] = self._hours.get(now, 0) + nbytes
            for h in [h for h in self._hours if h <= now - WINDOW_HOURS]:
                del self._hours[h]
            due = time.monotonic() - self._saved_at >= SAVE_EVERY_S
        if due:
            self.save()

    def save(self) -> None:
        """Write the ledger (atomically, owner-only; a failure leaves the old file)."""
        if self.path is None:
            return
        with self._lock:
            self._saved_at = time.monotonic()
            body = {
                "total_bytes": self.total_bytes,
                "total_files": self.total_files,
                "hours": {str(h): n for h, n in sorted(self._hours.items())},
            }
        try:
            write_atomic(self.path, body)  # 0600, like every file in the cache dir
        except OSError:
            pass
