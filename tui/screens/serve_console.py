"""``tierchat serve --console``: the server's traffic and the live cache panels.

:class:`ServeConsoleScreen` shows the request log (one row per request: client, prompt
tokens, cached tokens by tier and kind, TTFT, queue wait, tok/s), the queue depth and the
cache panels, all read on one poll from the engine's stats and the request log. F5-F8
clear tiers as in the chat. F10 switches to the chat screen, whose turns go through the
same engine queue (and show in the log as client "chat"), and back.

Nothing here imports MLX: the engine is an ``EngineLike`` (the server's
``TrackedEngine``) and the log a :class:`~tierchat.core.serve.log.RequestLog`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.clock import Clock
from textual.containers import Horizontal
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Header
from tierchat.core.api import CacheStats, EngineLike
from tierchat.core.serve.log import RequestLog
from tierchat.tui import app as app_module
from tierchat.tui.app import TierchatApp
from tierchat.tui.commands import CacheCommands
from tierchat.tui.screens.chat import ChatScreen
from tierchat.tui.screens.confirm import confirm_clear
from tierchat.tui.services.clear_requests import ClearRequests
from tierchat.tui.widgets.cache_panels import CachePanels
from tierchat.tui.widgets.footer import KeyFooter
from tierchat.tui.widgets.request_log import RequestLogView

POLL_S = 0.5
"""Seconds between polls of the stats and the request log while the console is shown."""


class ServeConsoleScreen(Screen):
    """The request log and the cache panels of a running server."""

    DEFAULT_CSS = """
    ServeConsoleScreen #serve-body { height: 1fr; }
    ServeConsoleScreen #requests { width: 1fr; }
    ServeConsoleScreen #panels { height: 1fr; }
    """
    COMMANDS = Screen.COMMANDS | {CacheCommands}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("f2", "toggle_panels", "Cache", id="toggle_panels"),
        Binding("f5", "clear('hot')", "Clear hot", id="clear_hot", priority=True),
        Binding("f6", "clear('ssd')", "Clear SSD", id="clear_ssd", priority=True),
        Binding("f7", "clear('tails')", "Clear tails", id="clear_tails", priority=True),
        Binding("f8", "clear('all')", "Clear all", id="clear_all", priority=True),
    ]

    def __init__(
        self, log: RequestLog, *, clock: Clock | None = None, clock_time=time.localtime
    ) -> None:
        super().__init__()
        self.request_log = log
        self._clock = clock
        self._clock_time = clock_time
        self._timer: Timer | None = None

    @property
    def engine(self) -> EngineLike:
        return self.app.engine  # type: ignore[attr-defined]

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        with Horizontal(id="serve-body"):
            yield RequestLogView(clock_time=self._clock_time, id="requests")
            yield CachePanels(clock=self._clock, id="panels")
        yield KeyFooter()

    def on_mount(self) -> None:
        self.title = "tierchat serve"
        self.sub_title = f"{self.request_log.url or 'starting'} · {self.engine.model_name}"
        self._timer = self.set_interval(POLL_S, self.poll)
        self.poll()

    def on_screen_suspend(self) -> None:
        if self._timer is not None:
            self._timer.pause()

    def on_screen_resume(self) -> None:
        if self._timer is not None:
            self.poll()
            self._timer.resume()

    def poll(self) -> CacheStats | None:
        """Read one stats snapshot and one log snapshot into the widgets. Never raises."""
        self.query_one(RequestLogView).snapshot = self.request_log.snapshot()
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001 -- a failed poll shows stale panels, never a crash
            return None
        panels = self.query_one(CachePanels)
        if panels.display:
            panels.stats = stats
        return stats

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return True

    def action_toggle_panels(self) -> None:
        panels = self.query_one(CachePanels)
        panels.display = not panels.display
        self.poll()

    def action_clear(self, tier: str) -> None:
        confirm_clear(self, tier, self.clear_tier)

    def clear_tier(self, tier: str) -> None:
        """``Engine.clear`` waits for the engine thread (maybe mid-request): the clear
        runs in a thread worker (``tui/services/clear_requests.py``)."""
        ClearRequests(self, lambda: self.engine, self.notify, self.poll, None).clear(tier)


class ServeConsoleApp(TierchatApp):
    """The TUI of ``tierchat serve --console``: the console screen first, the chat one
    F10 away (both on the same engine and queue)."""

    TITLE = "tierchat serve"
    # the app's stylesheets (relative to tui/app.py), not relative to this module
    CSS_PATH: ClassVar = [
        str(Path(app_module.__file__).parent / p)
        for p in (
            [TierchatApp.CSS_PATH]
            if isinstance(TierchatApp.CSS_PATH, str)
            else TierchatApp.CSS_PATH
        )
    ]
    BINDINGS: ClassVar[list[BindingType]] = [
        *TierchatApp.BINDINGS,
        Binding("f10", "toggle_chat", "Chat ⇄ console", id="toggle_chat", priority=True),
    ]

    def __init__(self, engine: EngineLike, store: Any, settings: Any, log: RequestLog, **kw):
        super().__init__(engine, store, settings, **kw)
        self.request_log = log

    def get_default_screen(self) -> Screen:
        return ServeConsoleScreen(self.request_log, clock=self.clock)

    def action_toggle_chat(self) -> None:
        if isinstance(self.screen, ChatScreen):
            self.pop_screen()
        elif isinstance(self.screen, ServeConsoleScreen):
            if not self.is_screen_installed("chat"):
                self.install_screen(ChatScreen(clock=self.clock), "chat")
            self.push_screen("chat")

    def binding_rows(self) -> list[tuple[str, str, str, str]]:
        rows = super().binding_rows()
        for binding in ServeConsoleScreen.BINDINGS + [ServeConsoleApp.BINDINGS[-1]]:
            if isinstance(binding, Binding):
                key = self.keymap.get(binding.id or "", binding.key)
                rows.append(("serve", key, binding.description, binding.id or ""))
        return rows
