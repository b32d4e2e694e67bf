"""The main screen: conversations | transcript + input | live cache panels.

Threads: the engine calls the ``on_event`` callbacks made here (``tui/services/
model_load.py``) and in ``tui/turns.py`` from its own thread. They only build messages
(``tierchat.tui.messages``) and ``post_message`` them; every widget is touched on the UI
thread, in the handlers below. Store writes and prompt building run on the background
writer's thread (``tui/services/background.py``), awaited here without blocking the UI.

What the screen composes: :class:`TurnRunner` (the replies in flight, one per
conversation, and the reply stream shown), :class:`StatsPoller` (panels, status file,
alerts) and :class:`ClearRequests` (F5-F8 and ``tierchat cache clear`` from the CLI).

Keys: the chat input has the focus by default, so every binding of this screen is a key
the input does not type (Ctrl, Alt+arrows, F-keys, Esc). Actions on one message (edit,
fork, copy, branches) are single keys on the message cursor: Esc or Alt+↑ moves the focus
into the transcript (see ``widgets/transcript.py``; the targets are ``tui/cursor.py``).

Layout: at 140 columns and more the cache panels sit on the right; below, a one-line
summary replaces them (F2 shows them in place of the conversation list).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.clock import Clock
from textual.containers import Horizontal, Vertical
from textual.notifications import SeverityLevel
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Header, TextArea
from tierchat.core.api import CacheStats
from tierchat.core.live_status import StatusWriter
from tierchat.tui import cursor
from tierchat.tui.commands import (
    BranchCommands,
    CacheCommands,
    ConversationCommands,
    FoundMessages,
    ModelCommands,
    ToolCommands,
)
from tierchat.tui.cursor import MessageCursor
from tierchat.tui.draft_meter import DraftMeter
from tierchat.tui.messages import (
    BranchRequested,
    ConversationChosen,
    MessageClicked,
    MessageSubmitted,
    ModelLoadAdvanced,
    ModelLoadFailed,
    ModelLoadFinished,
    PathShown,
    PrefillAdvanced,
    ReplyFailed,
    ReplyFinished,
    ReplyStreamed,
    TypedInTranscript,
)
from tierchat.tui.screens.chat.conversations import ConversationActions, title_from
from tierchat.tui.screens.chat.models import ModelLoads
from tierchat.tui.screens.chat.tools import TOOL_BINDINGS, ChatTools
from tierchat.tui.screens.confirm import confirm_clear
from tierchat.tui.screens.prompt import EditMessageScreen
from tierchat.tui.services.clear_requests import ClearRequests
from tierchat.tui.services.model_load import device_line
from tierchat.tui.services.stats_poll import STATS_POLL_S, StatsPoller
from tierchat.tui.turns import SessionCall, TurnRunner
from tierchat.tui.widgets.activity import ActivityBar
from tierchat.tui.widgets.cache_panels import CachePanels, CacheSummary
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.conversation_list import ConversationList, ConversationRow
from tierchat.tui.widgets.footer import KeyFooter
from tierchat.tui.widgets.transcript import MessageInfo, MessageView, Transcript, message_infos

T = TypeVar("T")

if TYPE_CHECKING:
    from tierchat.tui.app import TierchatApp

WIDE_COLUMNS = 140
"""From this width on the cache panels sit beside the chat; below it, a summary line."""

__all__ = ["STATS_POLL_S", "WIDE_COLUMNS", "ChatScreen", "title_from"]


class ChatScreen(Screen):
    """Chat with the model and watch the cache. All state lives in the session and store;
    the screen only mirrors it (``Transcript.sync``); :class:`TurnRunner` tracks the
    replies in flight (one per conversation, several conversations at once)."""

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
    # Ctrl+C stops a reply too (as in every terminal chat); idle, "stop" is unavailable
    # and Ctrl+C reaches Textual's own binding (the quit hint).
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop", id="stop", priority=True),
        Binding("ctrl+c", "stop", "Stop", id="interrupt", show=False, priority=True),
        Binding("ctrl+r", "regenerate", "Regenerate", id="regenerate"),
        # priority: the terminal sends Alt+C as ESC c, a printable "c" the input would take
        Binding(
            "alt+c", "continue_reply", "Continue", id="continue_reply", show=False, priority=True
        ),
        Binding("alt+left", "swipe(-1)", "Prev branch", id="swipe_prev"),
        Binding("alt+right", "swipe(1)", "Next branch", id="swipe_next"),
        Binding("alt+up", "select(-1)", "Messages", id="select_prev"),
        Binding("alt+down", "select(1)", "Select next", id="select_next", show=False),
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
        *TOOL_BINDINGS,
    ]

    streaming: reactive[bool] = reactive(False, bindings=True)
    """A reply of the conversation shown is being generated (Esc stops it)."""
    loading_model: reactive[str] = reactive("", bindings=True)
    """The model being loaded on the engine thread, "" when none."""
    panels_visible: reactive[bool] = reactive(True, bindings=True)
    """The full cache panels are shown (else the one-line summary)."""
    conversation_id: reactive[int | None] = reactive(None, bindings=True)
    """The open conversation; None before the first message of a new one."""
    selected: reactive[int | None] = reactive(None, bindings=True)
    """Index of the message under the cursor; None: none (actions use the last one)."""

    def __init__(self, *, clock: Clock | None = None) -> None:
        super().__init__()
        self._clock = clock
        self.turns = TurnRunner(self)
        self.tools = ChatTools(self)
        self.conversation_actions = ConversationActions(self)
        self.models = ModelLoads(self)
        self.message_cursor = MessageCursor(self)
        self._narrow: bool | None = None
        self.stats_poll: StatsPoller | None = None
        self.clears: ClearRequests | None = None

    @property
    def tierchat(self) -> TierchatApp:
        return self.app  # type: ignore[return-value]

    @property
    def model_name(self) -> str:
        return self.tierchat.engine.model_name

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """As ``Widget.notify``, but plain text by default: engine and store messages are
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

    async def in_background(self, title: str, call: Callable[[], T]) -> tuple[bool, T | None]:
        """As :meth:`attempt`, with ``call`` on the background writer's thread (store
        writes, prompt building), in order with the writes asked for before it."""
        try:
            return True, await self.tierchat.writer.run(self, call)
        except Exception as e:  # noqa: BLE001 - the UI boundary: report, never crash
            self.notify(str(e) or type(e).__name__, title=title, severity="error", timeout=8)
            return False, None

    def widgets(self) -> tuple[Transcript, ActivityBar, ChatInput]:
        return self.query_one(Transcript), self.query_one(ActivityBar), self.query_one(ChatInput)

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        with Horizontal(id="body"):
            yield ConversationList(id="conversations")
            with Vertical(id="chat"):
                yield Transcript(welcome=self._welcome_text(), id="transcript")
                yield ActivityBar(clock=self._clock, id="activity")
                yield CacheSummary(id="summary")
                yield ChatInput(id="input")
            yield CachePanels(clock=self._clock, id="panels")
        yield KeyFooter()

    def _welcome_text(self) -> str:
        model = self.model_name or self.tierchat.settings.model
        return (
            f"tierchat · {model}\n\n"
            "Type a message and press Enter. Every turn reuses the KV cache of the "
            "conversation so far; the cache panels show where it came from.\n\n"
            "F1 keys · Ctrl+P commands · Esc/Alt+↑ message cursor · F9 settings · "
            "F2 cache panels · F4 model · Ctrl+N new chat"
        )

    def on_mount(self) -> None:
        self._fit_width(self.app.size.width)
        self.query_one(ChatInput).prompt_history = self._prompt_history
        cache_dir = getattr(self.tierchat.settings, "cache_dir", None)
        status = StatusWriter(Path(cache_dir), process="TUI") if cache_dir is not None else None
        engine = lambda: self.tierchat.engine  # noqa: E731 - the engine of the moment
        self.clears = ClearRequests(self, engine, self.notify, self.poll_stats, status)
        self.stats_poll = StatsPoller(engine, self._show_stats, self.notify, self.clears, status)
        self.set_interval(STATS_POLL_S, self.poll_stats, pause=False)
        self.refresh_conversations()
        rows = self.query_one(ConversationList).rows
        if rows:
            self.open_conversation(rows[0].id)
        self._update_titles()
        self.focus_input()
        self.poll_stats()
        if not self.model_name:
            self.load_model(self.tierchat.settings.model)

    def _prompt_history(self) -> list[str]:
        """What ↑ recalls in the input: the user messages of the open conversation's
        active path, oldest first."""
        return [i.content for i in self.path_infos() if i.role == "user" and i.node_id]

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

    def _update_titles(self) -> None:
        app = self.tierchat
        model = self.loading_model or self.model_name or app.settings.model
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

    # ------------------------------------------------------------------ availability

    def _views(self) -> list[MessageView]:
        return self.query_one(Transcript).views

    def _target(self) -> MessageView | None:
        """The message under the cursor, else the last message (never a placeholder)."""
        return cursor.target(self._views(), self.selected)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        busy = self.streaming or bool(self.loading_model)
        views, selected = self._views(), self.selected
        if action == "stop":
            return True if self.streaming else None
        if action == "regenerate":
            target = cursor.regenerate_target(views, selected)
            ok = not busy and target is not None and target.info.turn >= 0
            return True if ok else None
        if action == "continue_reply":
            target = cursor.continue_target(views, selected, self.model_name)
            return True if not busy and target is not None else None
        if action == "swipe":
            target = cursor.branch_target(views, selected)
            if busy or target is None:
                return None
            delta = int(parameters[0]) if parameters else 1
            return True if 0 <= target.info.index + delta < target.info.count else None
        if action in ("select", "select_edge"):
            return True if views else None
        if action == "edit":
            user = cursor.target_user(views, selected)
            return True if not busy and user is not None and user.info.node_id else None
        if action == "fork":
            target = self._target()
            ok = target is not None and target.info.role != "system" and not busy
            return True if ok else None
        if action == "copy":
            return True if self._target() is not None else None
        if action == "toggle_reasoning":  # a reply without reasoning says so
            target = self._target()
            return True if target is not None and target.info.role == "assistant" else None
        if action in ("rename_conversation", "delete_conversation", "export"):
            return True if self.conversation_id is not None and not self.streaming else None
        if action in ("pick_model", "load_model"):  # not under a reply of the old model
            return None if self.loading_model or self.turns.turns else True
        answer = self.tools.check_action(action, parameters)
        return super().check_action(action, parameters) if answer is NotImplemented else answer

    # ------------------------------------------------------------------ focus

    def focus_input(self) -> None:
        self.query_one(ChatInput).focus()

    def action_focus_input(self) -> None:
        self.focus_input()

    def on_descendant_focus(self, event) -> None:
        if isinstance(event.widget, Transcript):
            if self.selected is None and self._views():
                self.selected = len(self._views()) - 1
        elif isinstance(event.widget, ChatInput):
            self.selected = None

    @on(TypedInTranscript)
    def typed_in_transcript(self, event: TypedInTranscript) -> None:
        box = self.query_one(ChatInput)
        box.focus()
        box.insert(event.character)

    # ------------------------------------------------------------------ conversations

    def refresh_conversations(self) -> None:
        rows = [ConversationRow.from_store(c) for c in self.tierchat.store.list_conversations()]
        self.query_one(ConversationList).show(rows, self.conversation_id)

    def open_conversation(self, conversation_id: int) -> None:
        """Show ``conversation_id`` (with its reply in flight, if any)."""
        ok, _ = self.attempt(
            "Cannot open conversation", lambda: self.tierchat.session.open(conversation_id)
        )
        if not ok:
            return
        self._show_conversation(conversation_id)

    def _show_conversation(self, conversation_id: int | None) -> None:
        self.query_one(ActivityBar).hide()  # another conversation's progress or "stopping…"
        self.conversation_id = conversation_id
        self.selected = None
        self.sync_transcript()
        self.refresh_conversations()
        self._update_titles()
        self.query_one(ChatInput).forget_recall()
        self.draft_meter.changed()

    def watch_conversation_id(self) -> None:
        self.streaming = self.turns.streaming(self.conversation_id)

    def action_open_conversation(self, conversation_id: int) -> None:
        self.open_conversation(conversation_id)
        self.focus_input()

    @on(ConversationChosen)
    def conversation_chosen(self, event: ConversationChosen) -> None:
        if event.conversation_id != self.conversation_id:
            self.open_conversation(event.conversation_id)
        self.focus_input()

    def action_new_conversation(self) -> None:
        """Start an empty conversation; it is stored with its first message."""
        self.tierchat.session.conversation_id = None
        self._show_conversation(None)
        self.focus_input()

    async def _ensure_conversation(self, first_text: str | None) -> bool:
        """Create the conversation a first message (or, ``first_text`` None, a settings
        save: untitled until its first message) belongs to; a conversation that exists
        and holds no message yet takes its title from ``first_text``."""
        if self.conversation_id is not None:
            if first_text is not None:
                await self.conversation_actions.first_message(self.conversation_id, first_text)
            return True
        session = self.tierchat.session
        title = title_from(first_text) if first_text is not None else None
        create = lambda: session.new_conversation(title=title)  # noqa: E731
        ok, cid = await self.in_background("Cannot create conversation", create)
        if not ok:
            return False
        self.conversation_id = cid
        self.refresh_conversations()
        self._update_titles()
        return True

    def action_rename_conversation(self) -> None:
        self.conversation_actions.rename()

    def action_delete_conversation(self) -> None:
        self.conversation_actions.delete()

    def action_conversation_settings(self) -> None:
        self.conversation_actions.settings()

    # ------------------------------------------------------------------ transcript

    def path_infos(self, conversation_id: int | None = None) -> list[MessageInfo]:
        """The active path of ``conversation_id`` (default: the one shown) as
        :class:`MessageInfo` rows, from one store query."""
        cid = self.conversation_id if conversation_id is None else conversation_id
        if cid is None:
            return []
        session = self.tierchat.session
        system = session.settings(cid).system
        return message_infos(self.tierchat.store.active_path_entries(cid), system)

    @work(exclusive=True, group="sync")
    async def sync_transcript(self) -> None:
        """Mirror the active path in the transcript (and the reply in flight, if any)."""
        await self.turns.attach(self.path_infos())
        self._show_selection()
        self.refresh_bindings()

    def watch_selected(self) -> None:
        self._show_selection()

    def _show_selection(self) -> None:
        self.message_cursor.show()

    def action_select(self, delta: int) -> None:
        """Move the message cursor (and the focus into the transcript)."""
        self.message_cursor.move(delta)

    def action_select_edge(self, last: int) -> None:
        self.message_cursor.edge(bool(last))

    @on(MessageClicked)
    def message_clicked(self, event: MessageClicked) -> None:
        self.message_cursor.clicked(event.view)

    @on(BranchRequested)
    async def branch_requested(self, event: BranchRequested) -> None:
        action = self.message_cursor.branch_action(event.node_id, event.action)
        if action is not None:
            await self.run_action(action)

    # ------------------------------------------------------------------ generation

    async def start_turn(self, call: Callable[[Any, int, Any], Any]) -> bool:
        """Start a turn of the conversation shown: ``call(session, conversation_id,
        on_event)`` runs on the background writer's thread (the store write and the
        prompt)."""
        cid, session = self.conversation_id, self.tierchat.session
        assert cid is not None
        run: SessionCall = lambda on_event: call(session, cid, on_event)  # noqa: E731
        return await self.turns.start(cid, run)

    @on(MessageSubmitted)
    async def message_submitted(self, event: MessageSubmitted) -> None:
        if self.streaming:
            self.notify("A reply is still streaming; Esc stops it.", severity="warning")
            return
        if self.loading_model:
            self.notify(f"{self.loading_model} is still loading.", severity="warning")
            return
        if not self.model_name:  # before a conversation is made for it
            self.notify(
                "no model is loaded: F4 picks one; your message stays in the input.",
                title="Cannot generate",
                severity="error",
            )
            return
        if not await self._ensure_conversation(event.text):
            return
        text = event.text

        def send(session, cid, on_event):
            return session.send(text, on_event=on_event, conversation_id=cid)

        if await self.start_turn(send):  # refused: the text stays in the input
            self.query_one(ChatInput).clear()

    async def action_regenerate(self) -> None:
        """A new reply to the user turn of the message under the cursor (from the input:
        the last one), a sibling of the reply shown there; its prompt ends at that user
        message."""
        target = cursor.regenerate_target(self._views(), self.selected)
        if target is None or target.info.turn < 0:
            return
        turn = target.info.turn
        note = cursor.regenerate_note(self.tierchat.session.settings(), target.info.role)
        if note:
            self.notify(note, timeout=5)
        await self.start_turn(
            lambda s, cid, cb: s.regenerate(turn=turn, on_event=cb, conversation_id=cid)
        )
        self.focus_input()

    async def action_continue_reply(self) -> None:
        """Generate more of a cut reply: its prompt + its ids, all in the resident cache
        (nothing prefilled); the whole reply becomes a new sibling (the cut one stays)."""
        target = cursor.continue_target(self._views(), self.selected, self.model_name)
        if target is None:
            return
        node_id = target.info.node_id
        await self.start_turn(lambda s, cid, cb: s.continue_reply(node_id, on_event=cb))
        self.focus_input()

    def action_edit(self) -> None:
        user = cursor.target_user(self._views(), self.selected)
        if user is None:
            return
        turn = user.info.turn

        async def done(text: str | None) -> None:
            if text is None:
                return
            await self.start_turn(
                lambda s, cid, cb: s.edit(turn, text, on_event=cb, conversation_id=cid)
            )
            self.focus_input()

        self.app.push_screen(EditMessageScreen(user.info.content, turn), done)

    def action_stop(self) -> None:
        self.turns.stop()

    @on(PrefillAdvanced)
    async def prefill_advanced(self, event: PrefillAdvanced) -> None:
        await self.turns.prefill(event)

    @on(ReplyStreamed)
    async def reply_streamed(self, event: ReplyStreamed) -> None:
        await self.turns.streamed(event)

    @on(ReplyFinished)
    async def reply_finished(self, event: ReplyFinished) -> None:
        await self.turns.finished(event)

    @on(ReplyFailed)
    async def reply_failed(self, event: ReplyFailed) -> None:
        await self.turns.failed(event)

    def message_withdrawn(self, conversation_id: int, text: str) -> None:
        """The session dropped the user message ``text``: a title made from it goes."""
        self.run_worker(self.conversation_actions.withdrawn(conversation_id, text))

    def turns_changed(self, *, ended: bool, first_token: bool = False) -> None:
        """A turn started, streamed its first token (the engine's last-turn record is now
        its own: poll), or ended: refresh the list, the keys, the panels and the context
        the input's border shows."""
        self.streaming = self.turns.streaming(self.conversation_id)
        if first_token:
            self.poll_stats()
        elif ended:
            self.refresh_conversations()
            self._show_selection()
            self.refresh_bindings()
            self.poll_stats()
            self.draft_meter.changed()
        else:
            self.selected = None

    # ------------------------------------------------------------------ branches

    async def action_swipe(self, delta: int) -> None:
        """Show the previous/next sibling of the message under the cursor (a reply, or a
        user message that edits made into branches)."""
        target = cursor.branch_target(self._views(), self.selected)
        if target is None or target.info.node_id is None:
            return
        index = target.info.index + delta
        if not 0 <= index < target.info.count:
            return
        store = self.tierchat.store
        node_id, role = target.info.node_id, target.info.role

        def pick():
            siblings = [n for n in store.siblings(node_id) if n.role == role]
            return self.tierchat.session.select(siblings[index].id)

        selected = self.selected
        ok, _ = await self.in_background("Cannot show that branch", pick)
        if not ok:
            return
        await self.query_one(Transcript).sync(self.path_infos())
        self.selected = selected
        self._show_selection()
        self.refresh_bindings()

    # ------------------------------------------------------------------ tools

    def action_search(self, scope: str = "here") -> None:
        self.tools.search(scope)

    async def action_open_found(self, node_id: int) -> None:
        await self.tools.open_found(node_id)

    def action_raw_message(self) -> None:
        self.tools.raw_message()

    def action_verify_turn(self) -> None:
        self.tools.verify_turn()

    def action_copy_code(self) -> None:
        self.tools.copy_code()

    def action_delete_message(self) -> None:
        self.tools.delete_message()

    def action_delete_branch(self) -> None:
        self.tools.delete_branch()

    async def action_undo_delete(self) -> None:
        await self.tools.undo_delete()

    def action_clear_input(self) -> None:
        self.tools.clear_input()

    def action_edit_in_editor(self) -> None:
        self.tools.edit_in_editor()

    def action_import_conversation(self) -> None:
        self.tools.import_conversation()

    async def action_fork(self) -> None:
        await self.tools.fork()

    def action_copy(self) -> None:
        self.tools.copy()

    def action_toggle_reasoning(self) -> None:
        self.tools.toggle_reasoning()

    async def action_export(self, fmt: str = "md", scope: str = "path") -> None:
        await self.tools.export(fmt, scope)

    @property
    def draft_meter(self) -> DraftMeter:
        return self.tools.draft_meter

    @on(TextArea.Changed, "#input")
    def _draft_changed(self) -> None:
        self.tools.draft_meter.changed()

    @on(PathShown)
    def _path_shown(self, event: PathShown) -> None:
        self.tools.draft_meter.path_shown(event.node_ids)

    # ------------------------------------------------------------------ model

    def action_pick_model(self) -> None:
        self.models.pick()

    def load_model(self, spec: str) -> None:
        """Ask the engine to load ``spec``; progress and the result arrive as messages."""
        self.models.load(spec)

    def action_load_model(self, spec: str) -> None:
        self.models.load(spec)

    @on(ModelLoadAdvanced)
    def model_load_advanced(self, event: ModelLoadAdvanced) -> None:
        self.models.advanced(event)

    @on(ModelLoadFinished)
    def model_load_finished(self, event: ModelLoadFinished) -> None:
        self.models.finished(event)

    @on(ModelLoadFailed)
    def model_load_failed(self, event: ModelLoadFailed) -> None:
        self.models.failed(event)

    # ------------------------------------------------------------------ cache

    def action_clear(self, tier: str) -> None:
        confirm_clear(self, tier, self.clear_tier)

    def clear_tier(self, tier: str) -> None:
        """Clear ``tier`` on the engine (no confirmation), off the UI thread."""
        if self.clears is not None:
            self.clears.clear(tier)

    def poll_stats(self) -> CacheStats | None:
        """One stats poll now (``tui/services/stats_poll.py``). Never raises."""
        return self.stats_poll.poll() if self.stats_poll is not None else None

    def _show_stats(self, stats: CacheStats) -> None:
        if self.panels_visible:
            self.query_one(CachePanels).stats = stats
        else:
            self.query_one(CacheSummary).stats = stats

    def action_toggle_panels(self) -> None:
        self.panels_visible = not self.panels_visible

    def watch_panels_visible(self, visible: bool) -> None:
        self.set_class(visible, "-panels")
        last = self.stats_poll.last if self.stats_poll is not None else None
        if last is not None:
            self._show_stats(last)

    def action_toggle_conversations(self) -> None:
        listing = self.query_one(ConversationList)
        self.toggle_class("-no-list")
        if not self.has_class("-no-list"):
            listing.focus()
        else:
            self.focus_input()

    def on_unmount(self) -> None:
        self.turns.stop_all()
        if self.stats_poll is not None:
            self.stats_poll.close()
