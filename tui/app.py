"""The Textual app: wiring of engine, store, session and settings; app-wide keys and help.

``run_app`` is what the CLI calls; ``TierchatApp`` is the factory tests use with a fake
engine. Nothing here imports MLX: the engine arrives as an ``EngineLike``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from textual import events, on
from textual.app import App
from textual.binding import Binding, BindingType
from textual.clock import Clock
from textual.dom import DOMNode
from textual.driver import Driver
from textual.notifications import SeverityLevel
from textual.screen import Screen
from tierchat.core.api import CacheStats, EngineLike
from tierchat.core.chat.trash import Trash
from tierchat.core.live_status import StatusWriter
from tierchat.tui.messages import KeyHandled
from tierchat.tui.screens.chat import ChatScreen
from tierchat.tui.screens.chat.pane import MessagePane
from tierchat.tui.screens.code_blocks import CodeBlocksScreen
from tierchat.tui.screens.confirm import ConfirmScreen
from tierchat.tui.screens.conversation_settings import ConversationSettingsScreen
from tierchat.tui.screens.help import HelpScreen
from tierchat.tui.screens.model_picker import ModelPickerScreen
from tierchat.tui.screens.prompt import EditMessageScreen, PromptScreen
from tierchat.tui.screens.raw_message import RawMessageScreen
from tierchat.tui.screens.search import SearchScreen
from tierchat.tui.screens.tool_approval import ToolApprovalScreen
from tierchat.tui.services.background import BackgroundWriter
from tierchat.tui.services.clear_requests import ClearRequests
from tierchat.tui.services.stats_poll import STATS_POLL_S, StatsPoller
from tierchat.tui.services.tools import ToolService
from tierchat.tui.terminal import KeyOrder, driver_class
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.conversation_list import ConversationList

HERE = Path(__file__).resolve().parent
T = TypeVar("T")


class TierchatApp(App[None]):
    """Chat with a local model and watch its prefix KV cache.

    Args:
        engine: an ``EngineLike`` (``tierchat.core.engine.engine.Engine``, or a fake in tests).
        store: the ``ConversationStore`` the session reads and writes.
        settings: ``tierchat.config.settings.Settings`` (model, sampling, keymap, ...).
        clock: a ``textual.clock.Clock`` or a ``() -> seconds`` callable for the progress
            bars; tests pass a fixed one so frames do not depend on wall time.
        session: a ready ``ChatSession``; by default one is built from the settings.
        device: the device and compute dtype for the header ("gpu (…, metal), bfloat16");
            "" shows the loaded model's (``ModelInfo.device_line``; the TUI never imports MLX).
        mcp_host: an ``McpHost`` of the configured MCP servers, not started (None: no
            tools); the app starts it and closes it at quit (``tui/services/tools.py``).
    """

    # The default screen's CSS_PATH is not read for a screen from get_default_screen()
    # (Textual 8 loads screen CSS on push/install only), so the app reads it.
    # Absolute: a relative CSS_PATH resolves against a *subclass's* file.
    CSS_PATH: ClassVar = [HERE / "app.tcss", HERE / "screens" / "chat" / "chat.tcss"]
    TITLE = "tierchat"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+q", "quit", "Quit", id="quit", priority=True),
        Binding("f1", "help", "Help", id="help"),
    ]

    def __init__(
        self,
        engine: EngineLike,
        store: Any,
        settings: Any,
        clock: Clock | Callable[[], float] | None = None,
        *,
        session: Any = None,
        device: str = "",
        mcp_host: Any = None,
    ) -> None:
        super().__init__()
        self.key_order = KeyOrder(self, lambda event: App.on_event(self, event))
        self.device = device
        self.engine = engine
        self.store = store
        self.trash = Trash(store)  # the last deletions and continues, kept in the store
        self.settings = settings
        if clock is not None and not isinstance(clock, Clock):
            clock = Clock(get_time=clock)
        self.clock: Clock | None = clock
        self.session = session if session is not None else self._make_session()
        self.writer = BackgroundWriter()  # store writes and prompts, off the UI loop
        self.keymap: dict[str, str] = dict(getattr(settings, "keymap", {}) or {})
        self.set_keymap(self.keymap)
        cache_dir = getattr(settings, "cache_dir", None)
        status = StatusWriter(Path(cache_dir), process="TUI") if cache_dir is not None else None
        engine_now = lambda: self.engine  # noqa: E731 - the engine of the moment
        self.clears = ClearRequests(self, engine_now, self.notify, self.poll_stats, status)
        """F5-F8 and ``tierchat cache clear`` from another shell (docs/DESIGN.md §10)."""
        self.stats_poll = StatsPoller(engine_now, self.notify, self.clears, status)
        """The one stats poll; the chat screen's panels subscribe (docs/DESIGN.md §16)."""
        self.tools = ToolService(mcp_host, self.notify, self.note_event, self.stats_poll)
        """The MCP servers and the tool rounds (docs/DESIGN.md §12.1)."""

    def _make_session(self) -> Any:
        from tierchat.core.chat.session import ChatSession

        return ChatSession.from_settings(self.engine, self.store, self.settings)

    async def on_event(self, event: events.Event) -> None:
        # the terminal's keys go to the widgets one at a time, in order (tui/terminal.py)
        if isinstance(event, events.Key) and not event.is_forwarded:
            await self.key_order.arrived(event)
            return
        await super().on_event(event)

    @on(KeyHandled)
    async def _key_handled(self, event: KeyHandled) -> None:
        event.stop()
        await self.key_order.handled(event.seq)

    def get_driver_class(self) -> type[Driver]:
        """Textual's driver, reading ESC-prefixed Alt keys as Alt keys (tui/terminal.py)."""
        return driver_class(super().get_driver_class())

    def get_default_screen(self) -> Screen:
        return ChatScreen(clock=self.clock)

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """As ``App.notify``, but plain text by default: engine and store messages are
        shown as they are (a ``[`` in them is not markup)."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def attempt(self, title: str, call: Callable[[], T]) -> tuple[bool, T | None]:
        """Run ``call``; any exception becomes an error notification titled ``title``.

        Engine and store reads go through here: the app never crashes on their errors.
        """
        try:
            return True, call()
        except Exception as e:  # noqa: BLE001 - the UI boundary: report, never crash
            self.notify(str(e) or type(e).__name__, title=title, severity="error", timeout=8)
            return False, None

    async def in_background(
        self, title: str, call: Callable[[], T], node: DOMNode | None = None
    ) -> tuple[bool, T | None]:
        """As :meth:`attempt`, with ``call`` on the background writer's thread (store
        writes, prompt building), in order with the writes asked for before it; ``node``
        (default: the app) owns the worker that waits for it."""
        try:
            return True, await self.writer.run(node or self, call)
        except Exception as e:  # noqa: BLE001 - the UI boundary: report, never crash
            self.notify(str(e) or type(e).__name__, title=title, severity="error", timeout=8)
            return False, None

    def note_event(self, text: str) -> None:
        """Add ``text`` to the Events log (the engine's cache events, ``Engine.note``);
        nothing for an engine without events. Any thread."""
        note = getattr(self.engine, "note", None)
        if note is not None:
            note(text)

    def poll_stats(self) -> CacheStats | None:
        """One stats poll now (``tui/services/stats_poll.py``). Never raises."""
        return self.stats_poll.poll()

    def clear_tier(self, tier: str) -> None:
        """Clear ``tier`` on the engine (no confirmation), off the UI thread."""
        self.clears.clear(tier)

    def on_mount(self) -> None:
        self.set_interval(STATS_POLL_S, self.poll_stats, pause=False)
        self.run_worker(self.tools.start(self.session, self.settings), group="mcp")
        unknown = sorted(set(self.keymap) - set(binding_ids()))
        if unknown:
            self.notify(
                f"Unknown binding id(s) in [keymap]: {', '.join(unknown)}. F1 lists the ids.",
                title="Keymap",
                severity="warning",
            )

    def on_unmount(self) -> None:
        self.stats_poll.close()  # the status file goes
        self.writer.close()  # the writes already asked for are stored
        self.tools.close()  # on a thread: run_app waits for it, bounded

    def binding_rows(self) -> list[tuple[str, str, str, str]]:
        """``(where, key, action, id)`` for every binding, with the keymap applied."""
        rows = [("app", self.get_key_display(Binding("ctrl+p", "")), "Command palette", "")]
        for where, owner in BINDING_OWNERS:
            for binding in _bindings(owner):
                keys = self.keymap.get(binding.id or "", binding.key)
                shown = " / ".join(
                    self.get_key_display(Binding(k.strip(), "")) for k in keys.split(",")
                )
                rows.append((where, shown, binding.description or binding.action, binding.id or ""))
        return rows

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.binding_rows()))


BINDING_OWNERS: tuple[tuple[str, type], ...] = (
    ("app", TierchatApp),
    ("chat", ChatScreen),
    ("input", ChatInput),
    ("messages", MessagePane),
    ("list", ConversationList),
    ("confirm", ConfirmScreen),
    ("rename", PromptScreen),
    ("edit", EditMessageScreen),
    ("settings", ConversationSettingsScreen),
    ("models", ModelPickerScreen),
    ("help", HelpScreen),
    ("search", SearchScreen),
    ("raw text", RawMessageScreen),
    ("code blocks", CodeBlocksScreen),
    ("tool approval", ToolApprovalScreen),
)


def _bindings(owner: type) -> list[Binding]:
    return [b for b in owner.BINDINGS if isinstance(b, Binding)]


def binding_ids() -> list[str]:
    """Every binding id a ``[keymap]`` table may name."""
    return [b.id for _, owner in BINDING_OWNERS for b in _bindings(owner) if b.id]


def run_app(
    engine: EngineLike, store: Any, settings: Any, *, device: str = "", mcp_host: Any = None
) -> None:
    """Run the TUI until the user quits. The caller owns (and closes) engine and store.

    When ``engine.model_name`` is empty the app loads ``settings.model`` itself, showing
    the engine's ``ModelLoading`` progress. ``device`` is shown in the header.
    ``mcp_host`` (the MCP servers, not started) is started by the app and closed at quit;
    the exit waits for it at most ``tui.services.tools.CLOSE_WAIT_S`` seconds.
    """
    app = TierchatApp(engine, store, settings, device=device, mcp_host=mcp_host)
    try:
        app.run()
    finally:
        app.tools.join()
