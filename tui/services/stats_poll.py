"""The app's stats poll: every ``STATS_POLL_S`` seconds one snapshot of the engine's
cache figures goes to the subscribers (the chat screen's panels or summary line), to the
status file that ``tierchat cache stats`` reads from another shell, and to the alerts;
the poll also serves the command line's clear requests (``tui/services/
clear_requests.py``; docs/DESIGN.md §10, §16). The app owns one poller
(``TierchatApp.stats_poll``); it polls while it has a subscriber.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tierchat.core.api import CacheStats
from tierchat.core.live_status import StatusWriter
from tierchat.tui.cache_report import alerts
from tierchat.tui.services.clear_requests import ClearRequests, Notify

STATS_POLL_S = 0.5
"""Seconds between stats polls (panels or summary, the status file, clear requests)."""


class StatsPoller:
    """Reads stats snapshots and hands them to its subscribers; never raises.

    Args:
        engine: ``() -> EngineLike``, the engine of the moment.
        notify: ``notify(text, title=..., severity=..., timeout=...)`` for the alerts.
        clears: serves the CLI's clear requests on each poll.
        status: the status file written on each poll; None without a cache directory.
    """

    def __init__(
        self,
        engine: Callable[[], Any],
        notify: Notify,
        clears: ClearRequests,
        status: StatusWriter | None,
    ) -> None:
        self.engine = engine
        self.subscribers: list[Callable[[CacheStats], None]] = []
        """Called with each snapshot on the UI thread (panels, a summary line)."""
        self.notify = notify
        self.clears = clears
        self.status = status
        self.last: CacheStats | None = None
        """The latest snapshot (None before the first that could be read)."""

    def subscribe(self, show: Callable[[CacheStats], None]) -> None:
        """Give ``show`` every snapshot from now on (and the latest one at once)."""
        self.subscribers.append(show)
        if self.last is not None:
            show(self.last)

    def unsubscribe(self, show: Callable[[CacheStats], None]) -> None:
        if show in self.subscribers:
            self.subscribers.remove(show)

    def poll(self) -> CacheStats | None:
        """Read one snapshot into the subscribers, the status file and the alerts; serve
        the clear requests waiting. Returns the snapshot (None when it could not be read,
        or when no one subscribes: nothing shows it)."""
        if not self.subscribers:
            return None
        stats = self.clears.stats()
        if stats is None:
            return None
        for show in list(self.subscribers):
            show(stats)
        before, self.last = self.last, stats
        for severity, title, text in alerts(before, stats):
            self.notify(text, title=title, severity=severity, timeout=8)
        if self.status is not None:
            self.status.write(self.engine().model_name, stats)
            self.clears.serve()
        return stats

    def close(self) -> None:
        """Remove the status file (at exit)."""
        if self.status is not None:
            self.status.remove()
