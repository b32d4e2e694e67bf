"""The main screen: conversations | message pane | live cache panels.

The screen owns the layout, the conversation shown (``conversation_id``), the model
being loaded and the screen-wide keys (stop, conversations, model, settings, cache
clears, panels). The message pane (``pane.py``, ``MessagePane``) owns the message
cursor, the replies in flight and every action on messages and the input, with their
keys; the screen forwards none of them. Conversation and model work is done by
``conversations.py`` and ``models.py`` through small host interfaces; the stats poll and
the cache clears are the app's (``TierchatApp.stats_poll``), the panels subscribe.

Threads: the engine calls the ``on_event`` callbacks made in ``tui/services/
model_load.py`` and ``tui/turns.py`` from its own thread. They only build messages
(``tierchat.tui.messages``) and ``post_message`` them; every widget is touched on the UI
thread. Store writes and prompt building run on the background writer's thread
(``tui/services/background.py``), awaited without blocking the UI.

Layout: at 140 columns and more the cache panels sit on the right; below, a one-line
summary replaces them (F2 shows them in place of the conversation list).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.clock import Clock
from textual.containers import Horizontal
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Header
from tierchat.core.api import CacheStats
from tierchat.tui.commands import (
    BranchCommands,
    CacheCommands,
    ConversationCommands,
    FoundMessages,
    ModelCommands,
    ToolCommands,
)
from tierchat.tui.messages import (
    ConversationChosen,
    ModelLoadAdvanced,
    ModelLoadFailed,
    ModelLoadFinished,
)
from tierchat.tui.screens.chat.conversations import ConversationActions, title_from
from tierchat.tui.screens.chat.models import ModelLoads
from tierchat.tui.screens.chat.pane import MessagePane
from tierchat.tui.screens.confirm import confirm_clear
from tierchat.tui.services.model_load import device_line
from tierchat.tui.services.stats_poll import STATS_POLL_S
from tierchat.tui.widgets.activity import ActivityBar
from tierchat.tui.widgets.cache_panels import CachePanels, CacheSummary
from tierchat.tui.widgets.conversation_list import ConversationList, ConversationRow
from tierchat.tui.widgets.footer import KeyFooter
from tierchat.tui.widgets.transcript import Transcript

if TYPE_CHECKING:
    from tierchat.tui.app import TierchatApp

WIDE_COLUMNS = 140
"""From this width on the cache panels sit beside the chat; below it, a summary line."""

__all__ = ["STATS_POLL_S", "WIDE_COLUMNS", "ChatScreen", "title_from"]


def welcome_text(model: str) -> str:
    """The empty transcript's note for ``model``."""
    return (
        f"tierchat · {model}\n\n"
        "Type a message and press Enter. Every turn reuses the KV cache of the "
        "conversation so far; the cache panels show where it came from.\n\n"
        "F1 keys · Ctrl+P commands · Esc/Alt+↑ message cursor · F9 settings · "
        "F2 cache panels · F4 model · Ctrl+N new chat"
    )


class ChatScreen(Screen):
    """Chat with the model and watch the cache. All state lives in the session and store;
    the screen shows one conversation (``conversation_id``) in its :class:`MessagePane`
    (:attr:`pane`), which tracks the replies in flight (one per conversation, several
    conversations at once)."""

    CSS_PATH = "chat.tcss"
    COMMANDS = Screen.COMMANDS | {
        CacheCommands,
        BranchCommands,
        ConversationCommands,
        ModelCommands,
        ToolCommands,
        FoundMessages,
    }
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [
        (0, "-narrow"),
        (WIDE_COLUMNS, "-wide"),
    ]

    # Priority: F6/F7 are TextArea keys, Esc must stop a reply whatever has the focus.
    # Ctrl+C stops a reply or a verify too (as in every terminal chat); idle, "stop" is
    # unavailable and Ctrl+C reaches Textual's own binding (the quit hint).
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop", id="stop", priority=True),
        Binding("ctrl+c", "stop", "Stop", id="interrupt", show=False, priority=True),
        Binding("ctrl+n", "new_conversation", "New", id="new_conversation"),
        Binding("ctrl+t", "rename_conversation", "Rename", id="rename_conversation", show=False),
        Binding("f2", "toggle_panels", "Cache", id="toggle_panels"),
        Binding("f3", "toggle_conversations", "Chats", id="toggle_conversations", show=False),
        Binding("f4", "pick_model", "Model", id="pick_model"),
        Binding("f9", "conversation_settings", "Settings", id="conversation_settings"),
        Binding("f5", "clear('hot')", "Clear hot", id="clear_hot", show=False, priority=True),
        Binding("f6", "clear('ssd')", "Clear SSD", id="clear_ssd", show=False, priority=True),
        Binding("f7", "clear('tails')", "Clear tails", id="clear_tails", show=False, priority=True),
        Binding("f8", "clear('all')", "Clear all", id="clear_all", show=False, priority=True),
    ]

    streaming: reactive[bool] = reactive(False, bindings=True)
    """A reply of the conversation shown is being generated (Esc stops it)."""
    loading_model: reactive[str] = reactive("", bindings=True)
    """The model being loaded on the engine thread, "" when none."""
    panels_visible: reactive[bool] = reactive(True, bindings=True)
    """The full cache panels are shown (else the one-line summary)."""
    conversation_id: reactive[int | None] = reactive(None, bindings=True)
    """The open conversation; None before the first message of a new one."""

    def __init__(self, *, clock: Clock | None = None) -> None:
        super().__init__()
        self._clock = clock
        self._narrow: bool | None = None
        self.conversations: ConversationActions | None = None
        self.models: ModelLoads | None = None

    @property
    def tierchat(self) -> TierchatApp:
        return self.app  # type: ignore[return-value]

    @property
    def pane(self) -> MessagePane:
        """The message pane: the transcript, the input, the cursor, the replies."""
        return self.query_one(MessagePane)

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        with Horizontal(id="body"):
            yield ConversationList(id="conversations")
            yield MessagePane(self, welcome=self.welcome_text(), clock=self._clock, id="chat")
            yield CachePanels(clock=self._clock, id="panels")
        yield KeyFooter()

    def welcome_text(self) -> str:
        app = self.tierchat
        return welcome_text(app.engine.model_name or app.settings.model)

    def on_mount(self) -> None:
        app, pane = self.tierchat, self.pane
        self._fit_width(app.size.width)
        listing = self.query_one(ConversationList)
        self.conversations = ConversationActions(self, app, listing)
        transcript, activity = pane.query_one(Transcript), pane.query_one(ActivityBar)
        self.models = ModelLoads(self, app, activity, transcript, pane.path_infos)
        app.stats_poll.subscribe(self._show_stats)
        self.conversations_changed()
        if listing.rows:
            self.open_conversation(listing.rows[0].id)
        pane.focus_input()
        app.poll_stats()
        if not app.engine.model_name:
            self.models.load(app.settings.model)

    def on_unmount(self) -> None:
        self.tierchat.stats_poll.unsubscribe(self._show_stats)

    def watch_loading_model(self, spec: str) -> None:
        # the engine has no cache while it loads: the panels say "loading", not "off"
        self.query_one(CachePanels).loading = spec
        self.query_one(CacheSummary).loading = spec

    def on_resize(self) -> None:
        self._fit_width(self.size.width)

    def _fit_width(self, width: int) -> None:
        """Panels beside the chat only from ``WIDE_COLUMNS`` on. Also runs at mount with
        the terminal's width, before the first layout: at 80 columns, list + chat + panels
        would leave the input a few cells, which Textual's ``TextArea`` cannot render."""
        narrow = width < WIDE_COLUMNS
        if narrow != self._narrow:
            self._narrow = narrow
            self.panels_visible = not narrow  # each layout starts with its own default
            self.set_class(self.panels_visible, "-panels")

    def model_changed(self) -> None:
        """The header names the model (or the one loading), the device and the
        conversation shown; the keys follow."""
        app = self.tierchat
        model = self.loading_model or app.engine.model_name or app.settings.model
        title = "new conversation"
        if self.conversation_id is not None:
            try:
                info = app.store.get_conversation(self.conversation_id)
                title = info.title or f"conversation {info.id}"
            except KeyError:
                pass
        device = device_line(app.engine, str(getattr(app, "device", "") or ""))
        self.title = "tierchat"
        self.sub_title = f"{model}{f' ({device})' if device else ''} · {title}"
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return True if self.streaming or self.pane.verifying else None
        if action in ("rename_conversation", "delete_conversation"):
            return True if self.conversation_id is not None and not self.streaming else None
        if action == "undo_delete":  # with nothing to undo, it says so
            return None if self.streaming else True
        if action in ("pick_model", "load_model"):  # not under a reply of the old model
            return None if self.loading_model or self.pane.turns.turns else True
        return super().check_action(action, parameters)

    # ------------------------------------------------------------------ conversations

    def conversations_changed(self) -> None:
        """The list and the header follow the store."""
        rows = [ConversationRow.from_store(c) for c in self.tierchat.store.list_conversations()]
        self.query_one(ConversationList).show(rows, self.conversation_id)
        self.model_changed()

    def open_conversation(self, conversation_id: int) -> None:
        """Show ``conversation_id`` (with its reply in flight, if any)."""
        session = self.tierchat.session
        ok, _ = self.tierchat.attempt(
            "Cannot open conversation", lambda: session.open(conversation_id)
        )
        if ok:
            self._show_conversation(conversation_id)

    def _show_conversation(self, conversation_id: int | None) -> None:
        self.conversation_id = conversation_id
        self.pane.conversation_shown()
        self.conversations_changed()

    def watch_conversation_id(self) -> None:
        self.streaming = self.replying(self.conversation_id)

    def replying(self, conversation_id: int | None) -> bool:
        """A reply of ``conversation_id`` is in flight, or its tool round runs."""
        return self.pane.replying(conversation_id)

    def action_open_conversation(self, conversation_id: int) -> None:
        self.open_conversation(conversation_id)
        self.pane.focus_input()

    @on(ConversationChosen)
    def conversation_chosen(self, event: ConversationChosen) -> None:
        if event.conversation_id != self.conversation_id:
            self.open_conversation(event.conversation_id)
        self.pane.focus_input()

    def new_conversation(self) -> None:
        """Show an empty conversation; it is stored with its first message."""
        self.tierchat.session.conversation_id = None
        self._show_conversation(None)

    def action_new_conversation(self) -> None:
        self.new_conversation()
        self.pane.focus_input()

    async def ensure_conversation(self, first_text: str | None) -> bool:
        """Create the conversation a first message (or, ``first_text`` None, a settings
        save: untitled until its first message) belongs to; a conversation that exists
        and holds no message yet takes its title from ``first_text``."""
        assert self.conversations is not None
        if self.conversation_id is not None:
            if first_text is not None:
                await self.conversations.first_message(self.conversation_id, first_text)
            return True
        session = self.tierchat.session
        title = title_from(first_text) if first_text is not None else None
        create = lambda: session.new_conversation(title=title)  # noqa: E731
        ok, cid = await self.tierchat.in_background("Cannot create conversation", create, self)
        if not ok:
            return False
        self.conversation_id = cid
        self.conversations_changed()
        return True

    def settings_changed(self) -> None:
        self.pane.sync_transcript()

    def action_rename_conversation(self) -> None:
        if self.conversations is not None:
            self.conversations.rename()

    def action_delete_conversation(self) -> None:
        if self.conversations is not None:
            self.conversations.delete()

    def action_conversation_settings(self) -> None:
        if self.conversations is not None:
            self.conversations.settings(self.sub_title.split(" · ")[-1])

    async def action_undo_delete(self) -> None:
        """Put the newest deletion of this session back (core/chat/trash.py): the
        conversation it was in is shown."""
        app = self.tierchat
        if not len(app.trash):
            app.notify("Nothing to undo: nothing was deleted in this session.", timeout=3)
            return
        ok, got = await app.in_background("Cannot undo", app.trash.restore, self)
        if not ok or got is None:
            return
        item, cid, _node = got
        self.open_conversation(cid)
        app.notify(f"Restored {item.label}.", title="Undo delete", timeout=3)

    # ------------------------------------------------------------------ replies

    def turns_changed(self, *, ended: bool, first_token: bool = False) -> None:
        """A turn started, streamed its first token (the engine's last-turn record is now
        its own: poll), or ended: the list (its streaming marks), the keys and the panels
        follow."""
        self.streaming = self.replying(self.conversation_id)
        self.query_one(ConversationList).mark_streaming(self.pane.turns.turns)
        if first_token:
            self.tierchat.poll_stats()
        elif ended:
            self.conversations_changed()
            self.tierchat.poll_stats()

    def action_stop(self) -> None:
        """Esc, whatever has the focus: stop the reply of the conversation shown (or the
        tool call its round runs), else a verify that runs."""
        self.pane.stop()

    # ------------------------------------------------------------------ model

    def action_pick_model(self) -> None:
        if self.models is not None:
            self.models.pick()

    def action_load_model(self, spec: str) -> None:
        if self.models is not None:
            self.models.load(spec)

    @on(ModelLoadAdvanced)
    def model_load_advanced(self, event: ModelLoadAdvanced) -> None:
        if self.models is not None:
            self.models.advanced(event)

    @on(ModelLoadFinished)
    def model_load_finished(self, event: ModelLoadFinished) -> None:
        if self.models is not None:
            self.models.finished(event)

    @on(ModelLoadFailed)
    def model_load_failed(self, event: ModelLoadFailed) -> None:
        if self.models is not None:
            self.models.failed(event)

    # ------------------------------------------------------------------ cache

    def action_clear(self, tier: str) -> None:
        confirm_clear(self, tier, self.tierchat.clear_tier)

    def _show_stats(self, stats: CacheStats) -> None:
        """A snapshot of the app's stats poll: to the panels, or the summary line (none
        while the screen is taken down)."""
        for shown in self.query(CachePanels if self.panels_visible else CacheSummary):
            shown.stats = stats

    def action_toggle_panels(self) -> None:
        self.panels_visible = not self.panels_visible

    def watch_panels_visible(self, visible: bool) -> None:
        self.set_class(visible, "-panels")
        last = self.tierchat.stats_poll.last
        if last is not None:
            self._show_stats(last)

    def action_toggle_conversations(self) -> None:
        listing = self.query_one(ConversationList)
        self.toggle_class("-no-list")
        if not self.has_class("-no-list"):
            listing.focus()
        else:
            self.pane.focus_input()
