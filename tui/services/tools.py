"""The app's MCP servers (docs/DESIGN.md §12.1, §16): the host started with the app, the
servers that failed said (a notification and the cache events, with their stderr tail),
the conversations' tool rounds (``ToolRounds``), and the host closed at quit on a thread
of its own, so the exit never waits longer than :data:`CLOSE_WAIT_S` for a server.

The CLI reads ``mcp.json`` (or ``--mcp-config``) and builds the host (a malformed file is
an error before the app starts); the app owns one :class:`ToolService`
(``TierchatApp.tools``), empty when no server is configured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

READY_WAIT_S = 120.0
"""How long the app waits for the servers to start before it says which did not."""
CLOSE_WAIT_S = 20.0
"""How long the exit waits for the servers to stop (``McpHost.close`` takes up to ~15 s)."""


class ToolService:
    """The MCP host of the app and the session's tool rounds.

    Args:
        host: an ``McpHost`` (not started) or a stand-in with its interface; None: no
            servers (:attr:`rounds` stays None).
        notify: ``notify(text, title=..., severity=..., timeout=...)`` on the UI thread.
        note: adds a line to the cache events (``Engine.note``); None when the engine has
            no events.
        stats: the app's ``StatsPoller``: a line is kept until a snapshot says the engine
            keeps events (``CacheStats.enabled``: a model loaded, with its cache), then
            noted; the engine drops lines while it has no cache, and the servers start
            while the model loads. None: noted at once.
    """

    def __init__(
        self,
        host: Any,
        notify: Callable[..., None],
        note: Callable[[str], None] | None = None,
        stats: Any = None,
    ) -> None:
        self.host = host
        self.notify = notify
        self.note = note
        self.stats = stats
        self.pending: list[str] = []
        """Lines for the cache events, kept until the engine keeps events."""
        self.rounds: Any = None
        """The session's ``ToolRounds`` once :meth:`start` ran; None without servers."""
        self.ready = asyncio.Event()
        """Set when every server is ready or failed (or there are none)."""
        self._closer: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.host is not None

    def server_names(self) -> tuple[str, ...]:
        """The configured servers, in config order."""
        return tuple(c.name for c in self.host.configs) if self.host is not None else ()

    async def start(self, session: Any, settings: Any) -> None:
        """Start the servers (the session gets the rounds at once; a new conversation
        gets the tools of the servers ready when it starts), wait for them off the UI
        loop, then say the ones that failed."""
        from tierchat.core.chat.tool_rounds import ToolRounds

        if self.host is None:
            self.ready.set()
            return
        self.host.start()
        self.rounds = ToolRounds.from_settings(session, self.host, settings)
        try:
            statuses = await asyncio.to_thread(self.host.wait_ready, READY_WAIT_S)
        finally:
            self.ready.set()
        # new conversations get the tools of every server that is ready
        ready_names = tuple(s.name for s in statuses if s.state == "ready")
        session.defaults = dataclasses.replace(session.defaults, tools=ready_names)
        ready = sum(1 for s in statuses if s.state == "ready")
        if ready:
            self.event(f"MCP: {ready} server(s) ready, {sum(len(s.tools) for s in statuses)} tools")
        for status in statuses:
            if status.state == "ready":
                continue
            why = status.error or f"still {status.state} after {READY_WAIT_S:.0f} s"
            self.notify(
                f"MCP server {status.name} ({status.transport}): {why}",
                title="Tool server failed",
                severity="error",
                timeout=15,
            )
            self.event(f"MCP server {status.name} failed: {why}")  # its stderr tail included

    def event(self, text: str) -> None:
        """Add ``text`` (lines) to the cache events, now or once the engine keeps events
        (:attr:`pending`). UI thread."""
        if self.note is None:
            return
        self.pending.append(text)
        if self.stats is None:
            self._deliver(None)
        elif len(self.pending) == 1:
            self.stats.subscribe(self._deliver)

    def _deliver(self, stats: Any) -> None:
        """A stats snapshot (None: none to wait for): the lines kept go to the engine when
        it keeps events."""
        if stats is not None and not stats.enabled:
            return
        lines, self.pending = self.pending, []
        for text in lines:
            self.note(text)
        if self.stats is not None:
            self.stats.unsubscribe(self._deliver)

    def close(self) -> None:
        """Stop the servers on a daemon thread (returns at once; :meth:`join` waits)."""
        if self.host is None or self._closer is not None:
            return
        self._closer = threading.Thread(target=self.host.close, name="mcp-close", daemon=True)
        self._closer.start()

    def join(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Wait up to ``timeout_s`` seconds for :meth:`close`; False when the servers are
        still stopping (the process may exit: the thread is a daemon)."""
        self.close()
        if self._closer is None:
            return True
        self._closer.join(timeout_s)
        return not self._closer.is_alive()
