"""The main screen: conversations | transcript + input | live cache panels.

Threads: the engine calls the ``on_event`` callbacks made here from its own thread. They
only build messages (``tierchat.tui.messages``) and ``post_message`` them; every widget is
touched on the UI thread, in the handlers below.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.clock import Clock
from textual.containers import Horizontal, Vertical
from textual.notifications import SeverityLevel
from textual.reactive import reactive
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Header
from tierchat.core.api import (
    CacheStats,
    Event,
    Failed,
    Finished,
    ModelLoaded,
    ModelLoading,
    PrefillProgress,
    TokenBatch,
)
from tierchat.tui.commands import (
    BranchCommands,
    CacheCommands,
    ConversationCommands,
    ModelCommands,
)
from tierchat.tui.format import fmt_bytes, metrics_from_meta
from tierchat.tui.messages import (
    BranchRequested,
    ConversationChosen,
    MessageClicked,
    MessageSubmitted,
    ModelLoadAdvanced,
    ModelLoadFailed,
    ModelLoadFinished,
    PrefillAdvanced,
    ReplyFailed,
    ReplyFinished,
    ReplyStreamed,
)
from tierchat.tui.models import model_choices
from tierchat.tui.screens.confirm import ConfirmScreen
from tierchat.tui.screens.model_picker import ModelPickerScreen
from tierchat.tui.screens.prompt import EditMessageScreen, PromptScreen
from tierchat.tui.widgets.activity import ActivityBar
from tierchat.tui.widgets.cache_panels import CachePanels
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.conversation_list import ConversationList, ConversationRow
from tierchat.tui.widgets.transcript import MessageInfo, MessageView, Transcript

T = TypeVar("T")

if TYPE_CHECKING:
    from tierchat.tui.app import TierchatApp

STATS_POLL_S = 0.5
"""Seconds between stats polls while the cache panels are shown."""

CLEAR_TEXT = {
    "hot": (
        "Clear the hot tier?",
        (
            "Drops every block held in RAM. Blocks already on the SSD tier stay there, so the "
            "next turn reloads them from disk."
        ),
    ),
    "ssd": (
        "Clear the SSD tier?",
        "Deletes every block file of this model's cache directory. The hot tier is kept.",
    ),
    "tails": (
        "Clear MRU tails and checkpoints?",
        (
            "Drops the partial tails and prompt-end checkpoints; regenerate will prefill the "
            "tail of the prompt again."
        ),
    ),
    "all": (
        "Clear every cache tier?",
        (
            "Drops the hot tier, the SSD tier, tails and checkpoints. The next turn is a cold "
            "prefill of the whole conversation."
        ),
    ),
}

FAILURE_TITLES = {
    "refused": "Prefill refused",
    "unsupported": "Model not supported",
    "error": "Engine error",
}


def title_from(text: str, width: int = 40) -> str:
    """A conversation title from its first message: first line, at most ``width`` chars."""
    line = text.strip().splitlines()[0] if text.strip() else "untitled"
    return line if len(line) <= width else line[: width - 1].rstrip() + "…"


class ChatScreen(Screen):
    """Chat with the model and watch the cache. All state lives in the session and store;
    the screen only mirrors it (``Transcript.sync``) and tracks the request in flight."""

    CSS_PATH = "chat.tcss"
    COMMANDS = Screen.COMMANDS | {
        CacheCommands,
        BranchCommands,
        ConversationCommands,
        ModelCommands,
    }

    # The cache keys are priority bindings: TextArea (the focused input) binds F6/F7.
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop", id="stop"),
        Binding("ctrl+r", "regenerate", "Regenerate", id="regenerate"),
        Binding("alt+left", "swipe(-1)", "◀ Reply", id="swipe_prev"),
        Binding("alt+right", "swipe(1)", "Reply ▶", id="swipe_next"),
        Binding("alt+up", "select(-1)", "Select previous", id="select_prev", show=False),
        Binding("alt+down", "select(1)", "Select next", id="select_next", show=False),
        Binding("alt+e", "edit", "Edit", id="edit", show=False),
        Binding("alt+f", "fork", "Fork", id="fork", show=False),
        Binding("alt+c", "copy", "Copy", id="copy", show=False),
        Binding("ctrl+n", "new_conversation", "New", id="new_conversation"),
        Binding("ctrl+t", "rename_conversation", "Rename", id="rename_conversation", show=False),
        Binding("f2", "toggle_panels", "Cache", id="toggle_panels"),
        Binding("f3", "toggle_conversations", "Chats", id="toggle_conversations", show=False),
        Binding("f4", "pick_model", "Model", id="pick_model"),
        Binding("f5", "clear('hot')", "Clear hot", id="clear_hot", show=False, priority=True),
        Binding("f6", "clear('ssd')", "Clear SSD", id="clear_ssd", show=False, priority=True),
        Binding("f7", "clear('tails')", "Clear tails", id="clear_tails", show=False, priority=True),
        Binding("f8", "clear('all')", "Clear all", id="clear_all", show=False, priority=True),
    ]

    streaming: reactive[bool] = reactive(False, bindings=True)
    """A reply is being generated (Esc stops it)."""
    loading_model: reactive[str] = reactive("", bindings=True)
    """The model being loaded on the engine thread, "" when none."""
    panels_visible: reactive[bool] = reactive(True, bindings=True)
    """The cache panels are shown (and polled)."""
    conversation_id: reactive[int | None] = reactive(None, bindings=True)
    """The open conversation; None before the first message of a new one."""
    selected: reactive[int | None] = reactive(None, bindings=True)
    """Index of the selected message in the transcript; None follows the last one."""

    def __init__(self, *, clock: Clock | None = None) -> None:
        super().__init__()
        self._clock = clock
        self._turn_key = 0
        self._turn_ready = asyncio.Event()
        self._turn_ready.set()
        self._handle: Any = None
        self._stream_view: MessageView | None = None
        self._poll_timer: Timer | None = None
        self._last_stats: CacheStats | None = None

    @property
    def tierchat(self) -> TierchatApp:
        return self.app  # type: ignore[return-value]

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

        Engine and store calls go through here: the app never crashes on their errors.
        """
        try:
            return True, call()
        except Exception as e:  # noqa: BLE001 - the UI boundary: report, never crash
            self.notify(str(e) or type(e).__name__, title=title, severity="error", timeout=8)
            return False, None

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        with Horizontal(id="body"):
            yield ConversationList(id="conversations")
            with Vertical(id="chat"):
                yield Transcript(welcome=self._welcome_text(), id="transcript")
                yield ActivityBar(clock=self._clock, id="activity")
                yield ChatInput(id="input")
            yield CachePanels(clock=self._clock, id="panels")
        yield Footer()

    def _welcome_text(self) -> str:
        model = self.tierchat.engine.model_name or self.tierchat.settings.model
        return (
            f"tierchat · {model}\n\n"
            "Type a message and press Enter. Every turn reuses the KV cache of the "
            "conversation so far; the panels on the right show where it came from.\n\n"
            "F1 keys · Ctrl+P commands · F2 cache panels · F4 model · Ctrl+N new chat"
        )

    def on_mount(self) -> None:
        self._poll_timer = self.set_interval(STATS_POLL_S, self.poll_stats, pause=False)
        self.refresh_conversations()
        rows = self.query_one(ConversationList).rows
        if rows:
            self.open_conversation(rows[0].id)
        self._update_titles()
        self.query_one(ChatInput).focus()
        self.poll_stats()
        if not self.tierchat.engine.model_name:
            self.load_model(self.tierchat.settings.model)

    def _update_titles(self) -> None:
        app = self.tierchat
        model = self.loading_model or app.engine.model_name or app.settings.model
        title = "new conversation"
        if self.conversation_id is not None:
            try:
                info = app.store.get_conversation(self.conversation_id)
                title = info.title or f"conversation {info.id}"
            except KeyError:
                pass
        self.title = "tierchat"
        self.sub_title = f"{model} · {title}"

    # ------------------------------------------------------------------ availability

    def _views(self) -> list[MessageView]:
        return self.query_one(Transcript).views

    def _target(self) -> MessageView | None:
        views = [v for v in self._views() if v.info.role != "system"]
        if not views:
            return None
        if self.selected is None or not 0 <= self.selected < len(self._views()):
            return views[-1]
        view = self._views()[self.selected]
        return view if view.info.role != "system" else views[0]

    def _target_reply(self) -> MessageView | None:
        target = self._target()
        if target is None or target.info.node_id is None:
            return None
        if target.info.role == "assistant":
            return target
        views = self._views()
        i = views.index(target)
        if i + 1 < len(views) and views[i + 1].info.role == "assistant":
            return views[i + 1]
        return None

    def _target_user(self) -> MessageView | None:
        target = self._target()
        if target is None:
            return None
        if target.info.role == "user":
            return target
        views = self._views()
        for view in reversed(views[: views.index(target)]):
            if view.info.role == "user":
                return view
        return None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        busy = self.streaming or bool(self.loading_model)
        if action == "stop":
            return True if self.streaming else None
        if action == "regenerate":
            views = self._views()
            ok = not busy and bool(views) and views[-1].info.role == "assistant"
            return True if ok and views[-1].info.node_id is not None else None
        if action == "swipe":
            reply = self._target_reply()
            if busy or reply is None:
                return None
            delta = int(parameters[0]) if parameters else 1
            index = reply.info.index + delta
            return True if 0 <= index < reply.info.count else None
        if action == "select":
            return True if self._views() else None
        if action == "edit":
            user = self._target_user()
            return True if not busy and user is not None and user.info.node_id else None
        if action in ("fork", "copy"):
            target = self._target()
            return True if target is not None and target.info.node_id is not None else None
        if action in ("rename_conversation", "delete_conversation"):
            return True if self.conversation_id is not None and not self.streaming else None
        if action in ("new_conversation", "open_conversation"):
            return None if self.streaming else True
        if action in ("pick_model", "load_model"):
            return None if busy else True
        return True

    # ------------------------------------------------------------------ conversations

    def refresh_conversations(self) -> None:
        rows = [ConversationRow.from_store(c) for c in self.tierchat.store.list_conversations()]
        self.query_one(ConversationList).show(rows, self.conversation_id)

    def open_conversation(self, conversation_id: int) -> None:
        ok, _ = self.attempt(
            "Cannot open conversation", lambda: self.tierchat.session.open(conversation_id)
        )
        if not ok:
            return
        self.conversation_id = conversation_id
        self.selected = None
        self.sync_transcript()
        self.refresh_conversations()
        self._update_titles()

    def action_open_conversation(self, conversation_id: int) -> None:
        self.open_conversation(conversation_id)

    @on(ConversationChosen)
    def conversation_chosen(self, event: ConversationChosen) -> None:
        if self.streaming:
            self.notify("A reply is streaming; Esc stops it.", severity="warning")
            return
        if event.conversation_id != self.conversation_id:
            self.open_conversation(event.conversation_id)
        self.query_one(ChatInput).focus()

    def action_new_conversation(self) -> None:
        """Start an empty conversation; it is stored with its first message."""
        self.conversation_id = None
        self.selected = None
        self.sync_transcript()
        self.refresh_conversations()
        self._update_titles()
        self.query_one(ChatInput).focus()

    def action_rename_conversation(self) -> None:
        cid = self.conversation_id
        if cid is None:
            return
        info = self.tierchat.store.get_conversation(cid)

        def done(title: str | None) -> None:
            if title is None:
                return
            ok, _ = self.attempt("Rename failed", lambda: self.tierchat.store.rename(cid, title))
            if not ok:
                return
            self.refresh_conversations()
            self._update_titles()
            self.notify(f"Renamed to “{title}”")

        self.app.push_screen(PromptScreen("Rename conversation", info.title or ""), done)

    def action_delete_conversation(self) -> None:
        listing = self.query_one(ConversationList)
        cid = listing.highlighted_id if listing.has_focus else self.conversation_id
        if cid is None:
            return
        info = self.tierchat.store.get_conversation(cid)
        title = info.title or f"conversation {cid}"

        def done(confirmed: bool | None) -> None:
            if not confirmed:
                return
            store = self.tierchat.store
            ok, _ = self.attempt("Delete failed", lambda: store.delete_conversation(cid))
            if not ok:
                return
            if cid == self.conversation_id:
                self.action_new_conversation()
            self.refresh_conversations()
            self.notify(f"Deleted “{title}”")

        body = f"“{title}” and every branch in it will be deleted from the store."
        self.app.push_screen(
            ConfirmScreen("Delete conversation?", body, confirm_label="Delete"), done
        )

    # ------------------------------------------------------------------ transcript

    def path_infos(self) -> list[MessageInfo]:
        """The active path as :class:`MessageInfo` rows (empty for a new conversation)."""
        if self.conversation_id is None:
            return []
        session = self.tierchat.session
        infos: list[MessageInfo] = []
        turn = -1
        for node in session.active_path():
            meta = node.meta or {}
            if node.role == "user":
                turn += 1
                infos.append(MessageInfo(node.id, "user", node.content, turn))
            elif node.role == "assistant":
                replies = [r.id for r in session.replies(turn)]
                index = replies.index(node.id) if node.id in replies else 0
                infos.append(
                    MessageInfo(
                        node.id,
                        "assistant",
                        node.content,
                        turn,
                        index=index,
                        count=max(len(replies), 1),
                        metrics=metrics_from_meta(meta),
                        model=str(meta.get("model", "")),
                    )
                )
            else:
                infos.append(MessageInfo(node.id, "system", node.content, -1))
        return infos

    @work(exclusive=True, group="sync")
    async def sync_transcript(self, upto: int | None = None) -> None:
        """Mirror the active path (up to node ``upto`` when given) in the transcript."""
        infos = self.path_infos()
        if upto is not None:
            ids = [i.node_id for i in infos]
            if upto in ids:
                infos = infos[: ids.index(upto) + 1]
        await self.query_one(Transcript).sync(infos)
        self._show_selection()
        self.refresh_bindings()

    def watch_selected(self) -> None:
        self._show_selection()

    def _show_selection(self) -> None:
        views = self._views()
        for i, view in enumerate(views):
            selected = self.selected is not None and i == self.selected
            if view.has_class("-selected") != selected:
                view.set_class(selected, "-selected")
        if self.selected is not None and 0 <= self.selected < len(views):
            views[self.selected].scroll_visible(animate=False)

    def action_select(self, delta: int) -> None:
        views = self._views()
        if not views:
            return
        current = len(views) - 1 if self.selected is None else self.selected
        self.selected = max(0, min(len(views) - 1, current + delta))

    @on(MessageClicked)
    def message_clicked(self, event: MessageClicked) -> None:
        views = self._views()
        if event.view in views:
            self.selected = views.index(event.view)

    @on(BranchRequested)
    async def branch_requested(self, event: BranchRequested) -> None:
        views = self._views()
        for i, view in enumerate(views):
            if view.info.node_id == event.node_id:
                self.selected = i
                break
        else:
            return
        action = {
            "prev": "swipe(-1)",
            "next": "swipe(1)",
            "regenerate": "regenerate",
            "edit": "edit",
            "fork": "fork",
            "copy": "copy",
        }.get(event.action)
        if action is not None:
            await self.run_action(action)

    # ------------------------------------------------------------------ generation

    def _callback(self, key: int) -> Callable[[Event], None]:
        """An ``on_event`` for the engine thread: events -> messages, nothing else."""
        parts: list[str] = []
        tokens = 0
        post = self.post_message

        def on_event(event: Event) -> None:
            nonlocal tokens
            if isinstance(event, TokenBatch):
                parts.append(event.text)
                tokens += len(event.token_ids)
                post(ReplyStreamed(key, "".join(parts), tokens))
            elif isinstance(event, PrefillProgress):
                post(PrefillAdvanced(key, event.done, event.total, event.tps))
            elif isinstance(event, Finished):
                post(ReplyFinished(key, event.text, event.metrics))
            elif isinstance(event, Failed):
                post(ReplyFailed(key, event.message, event.kind))

        return on_event

    async def _start(self, start: Callable[[Callable[[Event], None]], Any]) -> bool:
        """Run ``start(on_event)`` (a session call returning a turn handle) and mount the
        streaming reply. Returns False (with a notification) when the session refused.

        Actions run on the app's message pump, so the turn's first events may be handled
        by this screen before the placeholder is mounted; their handlers wait for
        ``_turn_ready``, which is set once the transcript is ready for them.
        """
        self._turn_key += 1
        self._turn_ready = ready = asyncio.Event()
        try:
            return await self._start_turn(start)
        finally:
            ready.set()

    async def _start_turn(self, start: Callable[[Callable[[Event], None]], Any]) -> bool:
        on_event = self._callback(self._turn_key)
        ok, handle = self.attempt("Cannot generate", lambda: start(on_event))
        if not ok:
            return False
        self._handle = handle
        self.streaming = True
        self.selected = None
        user = getattr(handle, "user_node", None)
        infos = self.path_infos()
        if user is not None:
            ids = [i.node_id for i in infos]
            if user.id in ids:
                infos = infos[: ids.index(user.id) + 1]
        transcript = self.query_one(Transcript)
        await transcript.sync(infos)
        turn = sum(1 for i in infos if i.role == "user") - 1
        model = self.tierchat.engine.model_name
        placeholder = MessageInfo(None, "assistant", "", turn, model=model)
        self._stream_view = await transcript.add_streaming_reply(placeholder)
        self._show_selection()
        return True

    @on(MessageSubmitted)
    async def message_submitted(self, event: MessageSubmitted) -> None:
        if self.streaming:
            self.notify("A reply is still streaming; Esc stops it.", severity="warning")
            return
        if self.loading_model:
            self.notify(f"{self.loading_model} is still loading.", severity="warning")
            return
        session = self.tierchat.session
        if self.conversation_id is None:
            title = title_from(event.text)
            ok, cid = self.attempt(
                "Cannot create conversation", lambda: session.new_conversation(title=title)
            )
            if not ok:
                return
            self.conversation_id = cid
            self.refresh_conversations()
            self._update_titles()
        if await self._start(lambda cb: session.send(event.text, on_event=cb)):
            self.query_one(ChatInput).clear()

    async def action_regenerate(self) -> None:
        session = self.tierchat.session
        await self._start(lambda cb: session.regenerate(on_event=cb))

    def action_edit(self) -> None:
        user = self._target_user()
        if user is None:
            return
        turn = user.info.turn

        async def done(text: str | None) -> None:
            if text is None:
                return
            session = self.tierchat.session
            await self._start(lambda cb: session.edit(turn, text, on_event=cb))

        self.app.push_screen(EditMessageScreen(user.info.content, turn), done)

    def action_stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    @on(PrefillAdvanced)
    def prefill_advanced(self, event: PrefillAdvanced) -> None:
        if event.turn_key == self._turn_key and self.streaming and event.done < event.total:
            self.query_one(ActivityBar).show_prefill(event.done, event.total, event.tps)

    @on(ReplyStreamed)
    async def reply_streamed(self, event: ReplyStreamed) -> None:
        if event.turn_key != self._turn_key:
            return
        await self._turn_ready.wait()
        if self._stream_view is None:
            return
        self.query_one(ActivityBar).hide()
        await self._stream_view.stream_to(event.text)

    @on(ReplyFinished)
    async def reply_finished(self, event: ReplyFinished) -> None:
        if event.turn_key != self._turn_key:
            return
        await self._turn_ready.wait()
        handle, self._handle = self._handle, None
        view, self._stream_view = self._stream_view, None
        self.query_one(ActivityBar).hide()
        reply = getattr(handle, "reply_node", None)
        infos = self.path_infos()
        stored = bool(infos) and infos[-1].role == "assistant"
        if view is not None and stored and (reply is None or infos[-1].node_id == reply.id):
            await view.finish(infos[-1])
        await self.query_one(Transcript).sync(infos)
        self.streaming = False
        self._restore_unsent(handle)
        self.refresh_conversations()
        self._show_selection()
        if event.metrics.finish_reason == "cancelled":
            self.notify("Generation stopped.", timeout=3)
        self.poll_stats()

    @on(ReplyFailed)
    async def reply_failed(self, event: ReplyFailed) -> None:
        if event.turn_key != self._turn_key:
            return
        await self._turn_ready.wait()
        handle, self._handle = self._handle, None
        self._stream_view = None
        self.query_one(ActivityBar).hide()
        title = FAILURE_TITLES.get(event.kind, "Engine error")
        # Nothing half is kept: the session dropped the failed turn; show the path as stored.
        await self.query_one(Transcript).sync(self.path_infos())
        self.streaming = False
        self._restore_unsent(handle)
        self.notify(event.message, title=title, severity="error", timeout=8)
        self.poll_stats()

    def _restore_unsent(self, handle: Any) -> None:
        """The session drops a user message whose turn failed; give its text back."""
        user = getattr(handle, "user_node", None)
        if user is None or getattr(handle, "kind", "") not in ("send", "edit"):
            return
        if any(i.node_id == user.id for i in self.path_infos()):
            return
        box = self.query_one(ChatInput)
        if not box.text.strip():
            box.load_text(user.content)

    # ------------------------------------------------------------------ branches

    async def action_swipe(self, delta: int) -> None:
        reply = self._target_reply()
        if reply is None:
            return
        index = reply.info.index + delta
        if not 0 <= index < reply.info.count:
            return
        selected = self.selected
        turn = reply.info.turn
        ok, _ = self.attempt("Swipe failed", lambda: self.tierchat.session.swipe(turn, index))
        if not ok:
            return
        await self.query_one(Transcript).sync(self.path_infos())
        self.selected = selected
        self._show_selection()
        self.refresh_bindings()

    def action_fork(self) -> None:
        target = self._target()
        if target is None or target.info.node_id is None:
            return
        node_id = target.info.node_id
        ok, new_id = self.attempt("Fork failed", lambda: self.tierchat.session.fork(node_id))
        if not ok or new_id is None:
            return
        self.open_conversation(new_id)
        self.notify(f"Forked into “{self.sub_title.split(' · ', 1)[-1]}”")

    def action_copy(self) -> None:
        target = self._target()
        if target is None:
            return
        text = target.text
        self.app.copy_to_clipboard(text)
        self.notify(f"Copied {len(text)} characters of the {target.info.role} message.")

    # ------------------------------------------------------------------ model

    def action_pick_model(self) -> None:
        app = self.tierchat
        choices = model_choices(getattr(app.settings, "models_dir", None))

        def done(spec: str | None) -> None:
            if spec:
                self.load_model(spec)

        self.app.push_screen(ModelPickerScreen(choices, app.engine.model_name), done)

    def load_model(self, spec: str) -> None:
        """Ask the engine to load ``spec``; progress and the result arrive as messages."""
        post = self.post_message

        def on_event(event: Event) -> None:
            if isinstance(event, ModelLoading):
                post(ModelLoadAdvanced(spec, event.done, event.total, event.message))
            elif isinstance(event, ModelLoaded):
                post(ModelLoadFinished(event.model, event.warning))
            elif isinstance(event, Failed):
                post(ModelLoadFailed(spec, event.message))

        self.loading_model = spec
        self.query_one(ActivityBar).show_loading(spec, 0, 1, "")
        self._update_titles()
        ok, _ = self.attempt(
            f"Cannot load {spec}", lambda: self.tierchat.engine.load_model(spec, on_event=on_event)
        )
        if not ok:
            self.loading_model = ""
            self.query_one(ActivityBar).hide()
            self._update_titles()

    def action_load_model(self, spec: str) -> None:
        self.load_model(spec)

    @on(ModelLoadAdvanced)
    def model_load_advanced(self, event: ModelLoadAdvanced) -> None:
        if event.model == self.loading_model:
            bar = self.query_one(ActivityBar)
            bar.show_loading(event.model, event.done, event.total, event.note)

    @on(ModelLoadFinished)
    def model_load_finished(self, event: ModelLoadFinished) -> None:
        self.loading_model = ""
        self.query_one(ActivityBar).hide()
        self._update_titles()
        self.query_one(Transcript).set_welcome(self._welcome_text())
        if event.warning:
            self.notify(event.warning, title=f"Loaded {event.model}", severity="warning")
        else:
            self.notify(f"{event.model} is ready.", title="Model loaded")
        self.poll_stats()

    @on(ModelLoadFailed)
    def model_load_failed(self, event: ModelLoadFailed) -> None:
        self.loading_model = ""
        self.query_one(ActivityBar).hide()
        self._update_titles()
        self.notify(event.message, title=f"Cannot load {event.model}", severity="error", timeout=10)
        self.poll_stats()

    # ------------------------------------------------------------------ cache

    def action_clear(self, tier: str) -> None:
        title, body = CLEAR_TEXT[tier]

        def done(confirmed: bool | None) -> None:
            if confirmed:
                self.clear_tier(tier)

        self.app.push_screen(ConfirmScreen(title, body, confirm_label="Clear"), done)

    @work(thread=True, group="clear")
    def clear_tier(self, tier: str) -> None:
        """Clear ``tier`` on the engine (no confirmation), then report it and refresh the
        panels. A thread worker: ``Engine.clear`` waits for the engine thread, which may be
        in the middle of a prefill chunk or a model load."""
        before = self._safe_stats()
        try:
            self.tierchat.engine.clear(tier)
        except Exception as e:  # noqa: BLE001 - reported on the UI thread below
            self.app.call_from_thread(self._clear_failed, tier, e)
        else:
            self.app.call_from_thread(self._cleared, tier, before)

    def _cleared(self, tier: str, before: CacheStats | None) -> None:
        after = self.poll_stats()
        self.notify(_clear_report(tier, before, after), title="Cache cleared")

    def _clear_failed(self, tier: str, error: Exception) -> None:
        self.notify(
            str(error) or type(error).__name__, title=f"Clear {tier} failed", severity="error"
        )
        self.poll_stats()

    def _safe_stats(self) -> CacheStats | None:
        try:
            return self.tierchat.engine.stats()
        except Exception:  # noqa: BLE001 - a failed poll shows stale panels, never a crash
            return None

    def poll_stats(self) -> CacheStats | None:
        """Read one stats snapshot into the panels (and raise alerts). Never raises."""
        stats = self._safe_stats()
        if stats is None:
            return None
        self.query_one(CachePanels).stats = stats
        before, self._last_stats = self._last_stats, stats
        for severity, title, text in _alerts(before, stats):
            self.notify(text, title=title, severity=severity, timeout=8)
        return stats

    def action_toggle_panels(self) -> None:
        self.panels_visible = not self.panels_visible

    def watch_panels_visible(self, visible: bool) -> None:
        self.query_one(CachePanels).display = visible
        if self._poll_timer is not None:
            if visible:
                self.poll_stats()
                self._poll_timer.resume()
            else:
                self._poll_timer.pause()

    def action_toggle_conversations(self) -> None:
        listing = self.query_one(ConversationList)
        listing.display = not listing.display
        if listing.display:
            listing.focus()

    def on_unmount(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


def _clear_report(tier: str, before: CacheStats | None, after: CacheStats | None) -> str:
    """ "hot tier: 12 blocks (48.0 KiB) dropped" style text for the clear notification."""
    if before is None or after is None:
        return f"Cleared {tier}."
    parts = []
    if tier in ("hot", "all"):
        n = before.hot.entries - after.hot.entries
        parts.append(f"hot: {n} blocks, {fmt_bytes(before.hot.nbytes - after.hot.nbytes)}")
    if tier in ("ssd", "all"):
        n = before.ssd.entries - after.ssd.entries
        parts.append(f"SSD: {n} files, {fmt_bytes(before.ssd.nbytes - after.ssd.nbytes)}")
    if tier in ("tails", "all"):
        parts.append(f"tails: {before.tails.entries - after.tails.entries} entries")
    return "Dropped " + "; ".join(parts) + "."


def _alerts(before: CacheStats | None, after: CacheStats) -> list[tuple[str, str, str]]:
    """Notifications for what got worse between two snapshots (disk errors, pressure, an
    uncacheable model); the first snapshot is compared with an empty one."""
    before = before or CacheStats()
    out: list[tuple[str, str, str]] = []
    if after.ssd.errors > before.ssd.errors:
        n = after.ssd.errors - before.ssd.errors
        cap = fmt_bytes(after.ssd.max_bytes)
        reason = f" ({after.ssd.reason})" if after.ssd.reason else ""
        out.append(
            ("error", "SSD tier write failed", f"{n} write error(s){reason}; cap now {cap}.")
        )
    if after.ssd.corrupt > before.ssd.corrupt:
        n = after.ssd.corrupt - before.ssd.corrupt
        out.append(("warning", "SSD tier", f"{n} unreadable block file(s) skipped and removed."))
    if after.memory.level != before.memory.level and after.memory.level in ("soft", "hard"):
        what = {
            "soft": "the hot tier shrinks to make room",
            "hard": "long prefills that would cross the limit are refused",
        }[after.memory.level]
        out.append(
            (
                "warning" if after.memory.level == "soft" else "error",
                f"Memory pressure {after.memory.level}",
                f"{fmt_bytes(after.memory.active)} active of {fmt_bytes(after.memory.limit)}: {what}.",
            )
        )
    if after.supported is False and before.supported is not False:
        out.append(("warning", "Cache off", after.reason or "this model cannot be cached"))
    return out
