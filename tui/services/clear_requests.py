"""Cache clears for the chat screen: the F5-F8 keys and ``tierchat cache clear`` from
another shell, which reaches a running TUI as a request file (``core/live_status.py``).

``Engine.clear`` waits for the engine thread (it may be in a prefill chunk or a model
load), so a clear runs in a Textual thread worker; its report (every process's one,
:func:`~tierchat.core.live_status.clear_tier`) is shown, and written to the status file for
a request from the command line, on the UI thread (docs/DESIGN.md §10).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual.dom import DOMNode
from tierchat.core.api import CacheStats
from tierchat.core.live_status import StatusWriter, check_tier, clear_tier, failure_report

Notify = Callable[..., None]


class ClearRequests:
    """Clears the engine's cache tiers off the UI thread and reports what went.

    Args:
        node: the widget or screen whose workers run the clears (and whose app calls
            back onto the UI thread).
        engine: ``() -> EngineLike``, the engine of the moment.
        notify: ``notify(text, title=..., severity=...)`` on the UI thread.
        refreshed: called on the UI thread after each clear (a stats poll).
        status: the status file, where requests from the CLI are answered; None when the
            app has no cache directory.
    """

    def __init__(
        self,
        node: DOMNode,
        engine: Callable[[], Any],
        notify: Notify,
        refreshed: Callable[[], object],
        status: StatusWriter | None,
    ) -> None:
        self.node = node
        self.engine = engine
        self.notify = notify
        self.refreshed = refreshed
        self.status = status
        self._serving: set[str] = set()  # ids of CLI requests already being served

    def stats(self) -> CacheStats | None:
        """One stats snapshot, or None when the engine cannot give one (never raises)."""
        try:
            return self.engine().stats()
        except Exception:  # noqa: BLE001 - a failed read shows stale panels, never a crash
            return None

    def clear(self, tier: str, request: dict | None = None) -> None:
        """Clear ``tier`` (no confirmation) in a thread worker, then report it.
        ``request``: a clear asked for by ``tierchat cache clear``, answered in the
        status file."""
        self.node.run_worker(
            lambda: self._clear(tier, request), thread=True, group="clear", exit_on_error=False
        )

    def _clear(self, tier: str, request: dict | None) -> None:
        call = self.node.app.call_from_thread
        try:
            report = clear_tier(self.engine(), tier)
        except Exception as e:  # noqa: BLE001 - reported on the UI thread below
            call(self._failed, tier, e, request)
        else:
            call(self._cleared, report, request)

    def serve(self) -> None:
        """Start a clear for every request from the CLI not yet being served; answer an
        unknown tier at once. Called from each stats poll."""
        if self.status is None:
            return
        for request in self.status.requests():
            try:
                check_tier(request["tier"])
            except ValueError as e:
                self.status.served(request, failure_report(e))
                continue
            if request["id"] not in self._serving:
                self._serving.add(request["id"])
                self.clear(request["tier"], request)

    def _cleared(self, report: str, request: dict | None) -> None:
        if request is not None and self.status is not None:
            self.status.served(request, report)
        self.refreshed()
        title = "Cache cleared" + (" (from the command line)" if request else "")
        self.notify(report, title=title)

    def _failed(self, tier: str, error: Exception, request: dict | None) -> None:
        text = str(error) or type(error).__name__
        if request is not None and self.status is not None:
            self.status.served(request, failure_report(error))
        self.notify(text, title=f"Clear {tier} failed", severity="error")
        self.refreshed()
