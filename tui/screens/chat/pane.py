"""The message pane: the transcript, the activity bar, the cache summary line and the chat
input of the chat screen, with the message cursor and every action on messages, replies
and the input (docs/DESIGN.md §16).

:class:`MessagePane` owns the state those actions read: the cursor (:attr:`MessagePane.
selected`), the replies in flight (:attr:`MessagePane.turns`, a ``TurnRunner`` whose host
is the pane) and the draft meter. Their keys are bound here, so they dispatch here: with
the transcript focused (the message cursor: plain keys) and with the input focused (Ctrl,
Alt and Esc keys; the input takes every printable key first). The actions beyond
chatting (raw text, verify, code blocks, delete, search, import, export, the input's
editor) are in ``message_actions.py``. The pane reaches the screen only through
:class:`ChatHost`: the conversation shown and what follows from switching it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.clock import Clock
from textual.containers import Vertical
from textual.notifications import SeverityLevel
from textual.reactive import reactive
from textual.widgets import TextArea
from textual.worker import Worker, WorkerCancelled, WorkerFailed
from tierchat.tui import cursor
from tierchat.tui.draft_meter import DraftMeter
from tierchat.tui.messages import (
    BranchRequested,
    MessageClicked,
    MessageSubmitted,
    PathShown,
    PrefillAdvanced,
    ReplyFailed,
    ReplyFinished,
    ReplyStreamed,
    TypedInTranscript,
)
from tierchat.tui.screens.chat.conversations import untitle_withdrawn
from tierchat.tui.screens.chat.message_actions import MESSAGE_TOOL_BINDINGS, MessageTools
from tierchat.tui.screens.chat.tool_rounds import ToolRoundRunner
from tierchat.tui.screens.prompt import EditMessageScreen
from tierchat.tui.turns import SessionCall, TurnRunner
from tierchat.tui.widgets.activity import ActivityBar
from tierchat.tui.widgets.cache_panels import CacheSummary
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.transcript import MessageInfo, MessageView, Transcript, message_infos

if TYPE_CHECKING:
    from tierchat.tui.app import TierchatApp


class ChatHost(Protocol):
    """What the message pane needs of the screen holding it."""

    @property
    def conversation_id(self) -> int | None:
        """The conversation shown; None before the first message of a new one."""

    @property
    def loading_model(self) -> str:
        """The model being loaded, "" when none (no reply starts meanwhile)."""

    def open_conversation(self, conversation_id: int) -> None:
        """Show ``conversation_id`` (the pane's :meth:`MessagePane.sync_transcript` runs)."""

    def ensure_conversation(self, first_text: str | None) -> Awaitable[bool]:
        """Create the conversation a first message belongs to (False after an error)."""

    def conversations_changed(self) -> None:
        """The store's conversations changed: the list and the titles follow."""

    def turns_changed(self, *, ended: bool, first_token: bool = False) -> None:
        """A turn started, streamed its first token, or ended (``ended``)."""


CURSOR_BINDINGS: list[BindingType] = [
    Binding("up,k", "select(-1)", "Up", id="msg_up"),
    Binding("down,j", "select(1)", "Down", id="msg_down"),
    Binding("home", "select_edge(0)", "First", id="msg_first", show=False),
    Binding("end", "select_edge(1)", "Last", id="msg_last", show=False),
    Binding("left,h", "swipe(-1)", "Prev branch", id="msg_prev_branch"),
    Binding("right,l", "swipe(1)", "Next branch", id="msg_next_branch"),
    Binding("e", "edit", "Edit", id="edit"),
    Binding("r", "regenerate", "Regenerate", id="msg_regenerate", show=False),
    Binding("f", "fork", "Fork", id="fork"),
    Binding("c", "copy", "Copy", id="copy"),
    Binding("t", "toggle_reasoning", "Reasoning", id="toggle_reasoning"),
    Binding("v", "raw_message", "Raw text", id="raw_message", show=False),
    Binding("V", "verify_turn", "Verify vs cold", id="verify_turn", show=False),
    Binding("y", "copy_code", "Copy code", id="copy_code", show=False),
    Binding("d", "delete_message", "Delete", id="delete_message", show=False),
    Binding("D", "delete_branch", "Delete branch", id="delete_branch", show=False),
    Binding("u", "screen.undo_delete", "Undo delete", id="undo_delete", show=False),
    Binding("escape,enter,i", "focus_input", "Type", id="msg_done"),
]
"""The message cursor's keys: plain keys, live while the transcript has the focus (the
input takes them first otherwise). The help lists them under "messages"."""

CHAT_BINDINGS: list[BindingType] = [
    Binding("ctrl+r", "regenerate", "Regenerate", id="regenerate"),
    # priority: the terminal sends Alt+C as ESC c, a printable "c" the input would take
    Binding("alt+c", "continue_reply", "Continue", id="continue_reply", show=False, priority=True),
    Binding("alt+left", "swipe(-1)", "Prev branch", id="swipe_prev"),
    Binding("alt+right", "swipe(1)", "Next branch", id="swipe_next"),
    Binding("alt+up", "select(-1)", "Messages", id="select_prev"),
    Binding("alt+down", "select(1)", "Select next", id="select_next", show=False),
    *MESSAGE_TOOL_BINDINGS,
]
"""The pane's keys the input does not type (Ctrl, Alt): live from the input too."""


class MessagePane(MessageTools, Vertical):
    """The chat column: transcript, activity bar, cache summary, input; the message
    cursor and the actions on messages, replies and the input (module docstring).

    Args:
        host: the screen showing a conversation here (:class:`ChatHost`).
        welcome: the transcript's note while it is empty.
        clock: the activity bar's clock (tests pass a fixed one).
    """

    BINDINGS: ClassVar[list[BindingType]] = [*CURSOR_BINDINGS, *CHAT_BINDINGS]

    selected: reactive[int | None] = reactive(None, bindings=True)
    """Index of the message under the cursor; None: none (actions use the last one)."""

    def __init__(
        self,
        host: ChatHost,
        *,
        welcome: str = "",
        clock: Clock | None = None,
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.host = host
        self._welcome = welcome
        self._clock = clock
        self.turns = TurnRunner(self)
        """The replies in flight, one per conversation; it shows the one of the
        conversation shown (``tui/turns.py``)."""
        self.tool_rounds = ToolRoundRunner(self)
        """The tool rounds after a reply with calls (``tool_rounds.py``)."""
        self._draft_meter: DraftMeter | None = None
        self._last_sync: Worker | None = None

    @property
    def tierchat(self) -> TierchatApp:
        return self.app  # type: ignore[return-value]

    @property
    def conversation_id(self) -> int | None:
        return self.host.conversation_id

    @property
    def model_name(self) -> str:
        return self.tierchat.engine.model_name

    @property
    def streaming(self) -> bool:
        """A reply of the conversation shown is in flight, or its tool round runs."""
        return self.replying(self.conversation_id)

    def replying(self, conversation_id: int | None) -> bool:
        """A reply of ``conversation_id`` is in flight, or its tool round runs."""
        return self.turns.streaming(conversation_id) or self.tool_rounds.active(conversation_id)

    @property
    def busy(self) -> bool:
        return self.streaming or bool(self.host.loading_model)

    def compose(self) -> ComposeResult:
        yield Transcript(welcome=self._welcome, id="transcript")
        yield ActivityBar(clock=self._clock, id="activity")
        yield CacheSummary(id="summary")
        yield ChatInput(id="input")

    def on_mount(self) -> None:
        self.query_one(ChatInput).prompt_history = self._prompt_history

    def on_unmount(self) -> None:
        self.turns.stop_all()  # the screen goes away

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """As ``Widget.notify``, plain text by default (engine and store messages)."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def in_background(self, title: str, call: Callable[[], Any]) -> Awaitable[tuple[bool, Any]]:
        """``TierchatApp.in_background``, its worker owned by this pane."""
        return self.tierchat.in_background(title, call, self)

    def widgets(self) -> tuple[Transcript, ActivityBar, ChatInput]:
        return self.query_one(Transcript), self.query_one(ActivityBar), self.query_one(ChatInput)

    def _prompt_history(self) -> list[str]:
        """What ↑ recalls in the input: the user messages of the open conversation's
        active path, oldest first."""
        return [i.content for i in self.path_infos() if i.role == "user" and i.node_id]

    @property
    def draft_meter(self) -> DraftMeter:
        if self._draft_meter is None:
            self._draft_meter = DraftMeter(self, self.query_one(ChatInput))
        return self._draft_meter

    # ------------------------------------------------------------------ the transcript

    def path_infos(self, conversation_id: int | None = None) -> list[MessageInfo]:
        """The active path of ``conversation_id`` (default: the one shown) as
        :class:`MessageInfo` rows, from one store query."""
        cid = self.conversation_id if conversation_id is None else conversation_id
        if cid is None:
            return []
        system = self.tierchat.session.settings(cid).system
        return message_infos(self.tierchat.store.active_path_entries(cid), system)

    def conversation_shown(self) -> Worker:
        """The host shows another conversation (or a new one): the cursor, the activity
        bar and the input's recall start afresh; the transcript syncs."""
        self.query_one(ActivityBar).hide()  # another conversation's progress or "stopping…"
        self.selected = None
        worker = self.sync_transcript()
        self.query_one(ChatInput).forget_recall()
        self.draft_meter.changed()
        return worker

    def sync_transcript(self) -> Worker:
        """Mirror the active path in the transcript (and the reply in flight, if any),
        in a worker (the newest replaces one still running)."""
        self._last_sync = self._sync()
        return self._last_sync

    async def synced(self) -> None:
        """Wait for the latest :meth:`sync_transcript` (a replaced one counts as done)."""
        if self._last_sync is not None:
            try:
                await self._last_sync.wait()
            except (WorkerCancelled, WorkerFailed):
                pass

    @work(exclusive=True, group="sync")
    async def _sync(self) -> None:
        await self.turns.attach(self.path_infos())
        self.show_selection()
        self.refresh_bindings()

    async def resync(self, selected: int | None) -> None:
        """Show the active path as stored now, the cursor at ``selected`` (kept in range)."""
        await self.query_one(Transcript).sync(self.path_infos())
        views = self.views()
        self.selected = None if selected is None or not views else min(selected, len(views) - 1)
        self.show_selection()
        self.refresh_bindings()

    # ------------------------------------------------------------------ the cursor

    def views(self) -> list[MessageView]:
        return self.query_one(Transcript).views

    def target(self) -> MessageView | None:
        """The message under the cursor, else the last message (never a placeholder)."""
        return cursor.target(self.views(), self.selected)

    def watch_selected(self) -> None:
        self.show_selection()

    def show_selection(self) -> None:
        """Mark the selected view (and scroll it into sight)."""
        views, selected = self.views(), self.selected
        for i, view in enumerate(views):
            on = selected is not None and i == selected
            if view.has_class("-selected") != on:
                view.set_class(on, "-selected")
        if selected is not None and 0 <= selected < len(views):
            views[selected].scroll_visible(animate=False)

    def action_select(self, delta: int) -> None:
        """Move the cursor by ``delta`` messages and the focus into the transcript; past
        the top, mount older messages first."""
        transcript = self.query_one(Transcript)
        views = transcript.views
        if not views:
            return
        if not transcript.has_focus:
            transcript.focus()
            if self.selected is None:
                self.selected = len(views) - 1  # the cursor starts on the newest message
                return
        current = len(views) - 1 if self.selected is None else self.selected
        if current + delta < 0 and transcript.hidden:
            self.run_worker(self._show_earlier(current + delta), group="earlier", exclusive=True)
            return
        self.selected = max(0, min(len(views) - 1, current + delta))

    async def _show_earlier(self, selected: int) -> None:
        """Mount older messages and keep the cursor on the message above the old top."""
        added = await self.query_one(Transcript).show_earlier()
        self.selected = max(0, selected + added)

    def action_select_edge(self, last: int) -> None:
        views = self.views()
        if views:
            self.selected = len(views) - 1 if last else 0

    @on(MessageClicked)
    def _message_clicked(self, event: MessageClicked) -> None:
        views = self.views()
        if event.view in views:
            self.query_one(Transcript).focus()
            self.selected = views.index(event.view)

    @on(BranchRequested)
    async def _branch_requested(self, event: BranchRequested) -> None:
        """A button of a message's branch bar: the cursor goes there, its action runs."""
        ids = [v.info.node_id for v in self.views()]
        if event.node_id not in ids:
            return
        self.selected = ids.index(event.node_id)
        action = cursor.BRANCH_ACTIONS.get(event.action)
        if action is not None:
            await self.run_action(action)

    def focus_input(self) -> None:
        self.query_one(ChatInput).focus()

    def action_focus_input(self) -> None:
        self.focus_input()

    @on(ChatInput.ToMessages)
    def _to_messages(self) -> None:
        if self.views():
            self.action_select(-1)

    def on_descendant_focus(self, event) -> None:
        if isinstance(event.widget, Transcript):
            if self.selected is None and self.views():
                self.selected = len(self.views()) - 1
        elif isinstance(event.widget, ChatInput):
            self.selected = None

    @on(TypedInTranscript)
    def _typed_in_transcript(self, event: TypedInTranscript) -> None:
        box = self.query_one(ChatInput)
        box.focus()
        box.insert(event.character)

    @on(TextArea.Changed, "#input")
    def _draft_changed(self) -> None:
        self.draft_meter.changed()

    @on(PathShown)
    def _path_shown(self, event: PathShown) -> None:
        self.draft_meter.path_shown(event.node_ids)

    # ------------------------------------------------------------------ availability

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        transcript_keys = self._cursor_key_state(action)
        if transcript_keys is not NotImplemented:
            return transcript_keys
        busy, views, selected = self.busy, self.views(), self.selected
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
            target = self.target()
            ok = target is not None and target.info.role != "system" and not busy
            return True if ok else None
        if action == "copy":
            return True if self.target() is not None else None
        if action == "toggle_reasoning":  # a reply without reasoning says so
            target = self.target()
            return True if target is not None and target.info.role == "assistant" else None
        if action == "export":
            return True if self.conversation_id is not None and not self.streaming else None
        answer = self.tool_state(action)
        return super().check_action(action, parameters) if answer is NotImplemented else answer

    def _cursor_key_state(self, action: str) -> bool | None:
        """``focus_input`` (Esc, Enter, i) is the transcript's key only: from the input
        Esc goes to the messages and Enter sends."""
        if action == "focus_input":
            return False if self.query_one(ChatInput).has_focus else True
        return NotImplemented  # type: ignore[return-value]

    # ------------------------------------------------------------------ replies

    async def start_turn(self, call: Callable[[Any, int, Any], Any]) -> bool:
        """Start a turn of the conversation shown: ``call(session, conversation_id,
        on_event)`` runs on the background writer's thread (the store write and the
        prompt)."""
        cid, session = self.conversation_id, self.tierchat.session
        assert cid is not None
        run: SessionCall = lambda on_event: call(session, cid, on_event)  # noqa: E731
        return await self.turns.start(cid, run)

    @on(MessageSubmitted)
    async def _message_submitted(self, event: MessageSubmitted) -> None:
        if event.text.strip().split(" ")[0] == "/tools":
            await self.tool_rounds.command(event.text.strip()[len("/tools") :].strip())
            self.query_one(ChatInput).clear()
            return
        if self.busy and not self.host.loading_model:
            self.notify("A reply is still streaming; Esc stops it.", severity="warning")
            return
        if self.host.loading_model:
            self.notify(f"{self.host.loading_model} is still loading.", severity="warning")
            return
        if not self.model_name:  # before a conversation is made for it
            self.notify(
                "no model is loaded: F4 picks one; your message stays in the input.",
                title="Cannot generate",
                severity="error",
            )
            return
        if not await self.host.ensure_conversation(event.text):
            return
        text = event.text

        def send(session, cid, on_event):
            return session.send(text, on_event=on_event, conversation_id=cid)

        if await self.start_turn(send):  # refused: the text stays in the input
            self.query_one(ChatInput).clear()

    async def action_regenerate(self) -> None:
        """A new reply to the user turn of the message under the cursor (from the input:
        the last one), a sibling of the reply shown there; its prompt ends at that user
        message. A step after a tool result is regenerated after that result."""
        target = cursor.regenerate_target(self.views(), self.selected)
        if target is None or target.info.turn < 0:
            return
        views = self.views()
        at = views.index(target)
        if target.info.role == "assistant" and at > 0 and views[at - 1].info.role == "tool":
            cid, node_id = self.conversation_id, target.info.node_id
            assert cid is not None and node_id is not None
            await self.turns.start(cid, self.tool_rounds.regenerate_call(node_id))
            self.focus_input()
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
        target = cursor.continue_target(self.views(), self.selected, self.model_name)
        if target is None:
            return
        node_id = target.info.node_id
        await self.start_turn(lambda s, cid, cb: s.continue_reply(node_id, on_event=cb))
        self.focus_input()

    def action_edit(self) -> None:
        user = cursor.target_user(self.views(), self.selected)
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

    async def action_swipe(self, delta: int) -> None:
        """Show the previous/next sibling of the message under the cursor (a reply, or a
        user message that edits made into branches)."""
        target = cursor.branch_target(self.views(), self.selected)
        if target is None or target.info.node_id is None:
            return
        index = target.info.index + delta
        if not 0 <= index < target.info.count:
            return
        store, session = self.tierchat.store, self.tierchat.session
        node_id, role = target.info.node_id, target.info.role

        def pick():
            siblings = [n for n in store.siblings(node_id) if n.role == role]
            return session.select(siblings[index].id)

        selected = self.selected
        ok, _ = await self.in_background("Cannot show that branch", pick)
        if ok:
            await self.resync(selected)

    def stop(self) -> None:
        """Esc: stop the reply of the conversation shown (and the tool call its round
        runs), else the verify that runs."""
        if self.streaming:  # a reply, or a tool round (a call running, an approval)
            self.turns.stop()
            self.tool_rounds.stop(self.conversation_id)
        else:
            self.stop_verify()

    @on(PrefillAdvanced)
    async def _prefill_advanced(self, event: PrefillAdvanced) -> None:
        await self.turns.prefill(event)

    @on(ReplyStreamed)
    async def _reply_streamed(self, event: ReplyStreamed) -> None:
        await self.turns.streamed(event)

    @on(ReplyFinished)
    async def _reply_finished(self, event: ReplyFinished) -> None:
        turn = await self.turns.finished(event)
        if turn is not None:  # its calls, if any, run now
            reason = event.metrics.finish_reason
            self.tool_rounds.after_turn(turn.conversation_id, turn.handle, reason)

    def start_round(self, conversation_id: int, call: SessionCall) -> Awaitable[bool]:
        """The next step of a tool round (``tool_rounds.py``)."""
        return self.turns.start(conversation_id, call)

    def rounds_changed(self, *, ended: bool) -> None:
        self.turns_changed(ended=ended)

    def ensure_conversation(self) -> Awaitable[bool]:
        return self.host.ensure_conversation(None)

    @on(ReplyFailed)
    async def _reply_failed(self, event: ReplyFailed) -> None:
        await self.turns.failed(event)

    def held_calls(self, handle: Any) -> Any:
        """:meth:`TurnHost.held_calls`: from the session's tokenizer and the turn's tools."""
        from tierchat.core.chat.tool_calls import HeldCalls

        if not getattr(handle, "tools", None):  # no tokenizer needed (test engines)
            return None
        try:
            return HeldCalls.for_turn(self.tierchat.session.engine, handle)
        except Exception:  # noqa: BLE001 - a parser that does not import, a decode: raw text
            return None

    def message_withdrawn(self, conversation_id: int, text: str) -> None:
        """The session dropped the user message ``text``: a title made from it goes."""
        store = self.tierchat.store
        call = lambda: untitle_withdrawn(store, conversation_id, text)  # noqa: E731

        async def retitle() -> None:
            ok, changed = await self.in_background("Cannot update the title", call)
            if ok and changed:
                self.host.conversations_changed()

        self.run_worker(retitle())

    def turns_changed(self, *, ended: bool, first_token: bool = False) -> None:
        """A turn started, streamed its first token, or ended: the keys, the cursor and
        the context the input's border shows follow; the host does the rest."""
        self.host.turns_changed(ended=ended, first_token=first_token)
        if first_token:
            return
        if ended:
            self.show_selection()
            self.refresh_bindings()
            self.draft_meter.changed()
        else:
            self.selected = None
