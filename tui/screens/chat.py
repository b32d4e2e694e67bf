"""The main screen: conversations | transcript + input | live cache panels.

Threads: the engine calls the ``on_event`` callbacks made here (and in ``tui/turns.py``)
from its own thread. They only build messages (``tierchat.tui.messages``) and
``post_message`` them; every widget is touched on the UI thread, in the handlers below.

Keys: the chat input has the focus by default, so every binding of this screen is a key
the input does not type (Ctrl, Alt+arrows, F-keys, Esc). Actions on one message (edit,
fork, copy, branches) are single keys on the message cursor: Esc or Alt+↑ moves the focus
into the transcript (see ``widgets/transcript.py``).

Layout: at 140 columns and more the cache panels sit on the right; below, a one-line
summary replaces them (F2 shows them in place of the conversation list).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypeVar

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
from tierchat.core.api import CACHE_TIERS, CacheStats, Event, Failed, ModelLoaded, ModelLoading
from tierchat.core.live_status import StatusWriter
from tierchat.tui.cache_report import alerts, clear_report
from tierchat.tui.commands import (
    BranchCommands,
    CacheCommands,
    ConversationCommands,
    FoundMessages,
    ModelCommands,
    ToolCommands,
)
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
    TypedInTranscript,
)
from tierchat.tui.models import model_choices
from tierchat.tui.screens.chat_tools import ChatTools
from tierchat.tui.screens.confirm import ConfirmScreen, confirm_clear
from tierchat.tui.screens.conversation_settings import ConversationSettingsScreen
from tierchat.tui.screens.model_picker import ModelPickerScreen
from tierchat.tui.screens.prompt import EditMessageScreen, PromptScreen
from tierchat.tui.turns import TurnRunner
from tierchat.tui.widgets.activity import ActivityBar
from tierchat.tui.widgets.cache_panels import CachePanels, CacheSummary
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.conversation_list import ConversationList, ConversationRow
from tierchat.tui.widgets.transcript import MessageInfo, MessageView, Transcript, message_infos

T = TypeVar("T")

if TYPE_CHECKING:
    from tierchat.tui.app import TierchatApp

STATS_POLL_S = 0.5
"""Seconds between stats polls (panels or summary, the status file, clear requests)."""

WIDE_COLUMNS = 140
"""From this width on the cache panels sit beside the chat; below it, a summary line."""


def title_from(text: str, width: int = 40) -> str:
    """A conversation title from its first message: first line, at most ``width`` chars."""
    line = text.strip().splitlines()[0] if text.strip() else "untitled"
    return line if len(line) <= width else line[: width - 1].rstrip() + "…"


class ChatScreen(ChatTools):
    """Chat with the model and watch the cache. All state lives in the session and store;
    the screen only mirrors it (``Transcript.sync``); :class:`TurnRunner` tracks the
    request in flight."""

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
    ]

    streaming: reactive[bool] = reactive(False, bindings=True)
    """A reply is being generated (Esc stops it)."""
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
        self._poll_timer: Timer | None = None
        self._last_stats: CacheStats | None = None
        self._narrow: bool | None = None
        self._status: StatusWriter | None = None
        self._serving: set[str] = set()  # clear requests from the CLI being served

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
                yield CacheSummary(id="summary")
                yield ChatInput(id="input")
            yield CachePanels(clock=self._clock, id="panels")
        yield Footer()

    def _welcome_text(self) -> str:
        model = self.tierchat.engine.model_name or self.tierchat.settings.model
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
        if cache_dir is not None:
            self._status = StatusWriter(Path(cache_dir), process="TUI")
        self._poll_timer = self.set_interval(STATS_POLL_S, self.poll_stats, pause=False)
        self.refresh_conversations()
        rows = self.query_one(ConversationList).rows
        if rows:
            self.open_conversation(rows[0].id)
        self._update_titles()
        self.focus_input()
        self.poll_stats()
        if not self.tierchat.engine.model_name:
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

    def _device(self) -> str:
        """The device and compute dtype for the header ("gpu (…, metal), bfloat16").

        ``core.device`` imports MLX, which the TUI never does itself: the line is read
        only when MLX is already loaded (by the real engine); the app's ``device`` (given
        by a caller) or an engine's own ``describe_device()`` take precedence."""
        describe = getattr(self.tierchat.engine, "describe_device", None)
        given = str(getattr(self.tierchat, "device", "") or "")
        try:
            if callable(describe):
                return str(describe())
            real = type(self.tierchat.engine).__module__.startswith("tierchat.core")
            if not given and real and "mlx.core" in sys.modules:
                from tierchat.core.engine.device import describe_device

                given = describe_device()
        except Exception:  # noqa: BLE001 - a header detail, never a crash
            pass
        return given

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
        device = self._device()
        self.title = "tierchat"
        self.sub_title = f"{model}{f' ({device})' if device else ''} · {title}"

    # ------------------------------------------------------------------ availability

    def _views(self) -> list[MessageView]:
        return self.query_one(Transcript).views

    def _target(self) -> MessageView | None:
        """The message under the cursor, else the last message (never a placeholder)."""
        views = [v for v in self._views() if v.info.node_id is not None]
        if not views:
            return None
        all_views = self._views()
        if self.selected is not None and 0 <= self.selected < len(all_views):
            view = all_views[self.selected]
            if view.info.node_id is not None:
                return view
        return views[-1]

    def _branch_target(self) -> MessageView | None:
        """The message whose siblings ←/→ move through: the one under the cursor (or,
        from the input, the last reply); a message without siblings gives none."""
        if self.selected is None:
            replies = [v for v in self._views() if v.info.role == "assistant"]
            target = replies[-1] if replies else None
        else:
            target = self._target()
        if target is None or target.info.node_id is None or target.info.role == "system":
            return None
        return target

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
            target = self._regenerate_target()
            ok = not busy and target is not None and target.info.turn >= 0
            return True if ok else None
        if action == "continue_reply":
            target = self._continue_target()
            return True if not busy and target is not None else None
        if action == "swipe":
            target = self._branch_target()
            if busy or target is None:
                return None
            delta = int(parameters[0]) if parameters else 1
            return True if 0 <= target.info.index + delta < target.info.count else None
        if action in ("select", "select_edge"):
            return True if self._views() else None
        if action == "edit":
            user = self._target_user()
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
        if action in ("new_conversation", "open_conversation", "conversation_settings"):
            return None if self.streaming else True
        if action in ("pick_model", "load_model"):
            return None if busy else True
        return super().check_action(action, parameters)  # ChatTools' actions

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
        self.query_one(ChatInput).forget_recall()
        self.draft_meter.changed()

    def action_open_conversation(self, conversation_id: int) -> None:
        self.open_conversation(conversation_id)
        self.focus_input()

    @on(ConversationChosen)
    def conversation_chosen(self, event: ConversationChosen) -> None:
        if self.streaming:
            self.notify("A reply is streaming; Esc stops it.", severity="warning")
            return
        if event.conversation_id != self.conversation_id:
            self.open_conversation(event.conversation_id)
        self.focus_input()

    def action_new_conversation(self) -> None:
        """Start an empty conversation; it is stored with its first message."""
        self.conversation_id = None
        self.tierchat.session.conversation_id = None
        self.selected = None
        self.sync_transcript()
        self.refresh_conversations()
        self._update_titles()
        self.focus_input()

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
        from_list = listing.has_focus
        cid = listing.highlighted_id if from_list else self.conversation_id
        if cid is None:
            return
        info = self.tierchat.store.get_conversation(cid)
        title = info.title or f"conversation {cid}"

        def done(confirmed: bool | None) -> None:
            if not confirmed:
                return
            trash = self.tierchat.trash
            ok, _ = self.attempt("Delete failed", lambda: trash.delete_conversation(cid))
            if not ok:
                return
            if cid == self.conversation_id:
                self.action_new_conversation()
            self.refresh_conversations()
            self.refresh_bindings()
            if from_list:  # u there brings it back
                listing.focus()
            self.notify(f"Deleted “{title}”; u undoes it (the list or the messages).")

        body = f"“{title}” and every branch in it will be deleted from the store."
        self.app.push_screen(
            ConfirmScreen("Delete conversation?", body, confirm_label="Delete"), done
        )

    def _ensure_conversation(self, first_text: str) -> bool:
        """Create the conversation a first message (or a settings save) belongs to."""
        if self.conversation_id is not None:
            return True
        session = self.tierchat.session
        title = title_from(first_text)
        ok, cid = self.attempt(
            "Cannot create conversation", lambda: session.new_conversation(title=title)
        )
        if not ok:
            return False
        self.conversation_id = cid
        self.refresh_conversations()
        self._update_titles()
        return True

    # ------------------------------------------------------------------ settings

    def action_conversation_settings(self) -> None:
        session = self.tierchat.session
        ok, current = self.attempt("Cannot read settings", lambda: session.settings())
        if not ok or current is None:
            return
        title = self.sub_title.split(" · ")[-1]

        def done(new) -> None:
            if new is None or new == current:
                return
            if not self._ensure_conversation(title if self.conversation_id else "untitled"):
                return
            if not self.attempt("Cannot save settings", lambda: session.save_settings(new))[0]:
                return
            self.sync_transcript()
            note = self._reuse_note(new.system, current) if new.system != current.system else ""
            extra = f" {note}" if note else ""
            self.notify(f"Saved for this conversation.{extra}", title="Settings")

        screen = ConversationSettingsScreen(
            current,
            title,
            reuse_note=lambda system: self._reuse_note(system, current),
            default_temperature=session.defaults.temperature,
        )
        self.app.push_screen(screen, done)

    def _reuse_note(self, system: str, current) -> str:
        """What a system prompt of ``system`` does to the next turn's cache reuse."""
        session = self.tierchat.session
        if system == current.system:
            return "System prompt unchanged: the next turn reuses the cached prefix."
        path = session.active_path()
        try:
            old = session.build_prompt(path, current)
            new = session.build_prompt(path, dataclasses.replace(current, system=system))
        except Exception:  # noqa: BLE001 - no model yet: say it in general terms
            return "A new system prompt is a new prefix: the next turn prefills from the start."
        shared = 0
        for a, b in zip(old.token_ids, new.token_ids, strict=False):
            if a != b:
                break
            shared += 1
        total = len(new.token_ids)
        return (
            f"New prefix: the prompt changes at token {shared} of {total}, so the next turn "
            f"prefills about {total - shared} tokens again. The old prefix stays cached; "
            "switching back reuses it."
        )

    # ------------------------------------------------------------------ transcript

    def path_infos(self) -> list[MessageInfo]:
        """The active path as :class:`MessageInfo` rows, from one store query."""
        if self.conversation_id is None:
            return []
        session = self.tierchat.session
        system = session.settings().system
        return message_infos(session.path_entries(), system)

    @work(exclusive=True, group="sync")
    async def sync_transcript(self) -> None:
        """Mirror the active path in the transcript."""
        await self.query_one(Transcript).sync(self.path_infos())
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
        """Move the message cursor (and the focus into the transcript)."""
        views = self._views()
        if not views:
            return
        transcript = self.query_one(Transcript)
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
        views = self._views()
        if views:
            self.selected = len(views) - 1 if last else 0

    @on(MessageClicked)
    def message_clicked(self, event: MessageClicked) -> None:
        views = self._views()
        if event.view in views:
            self.query_one(Transcript).focus()
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

    @on(MessageSubmitted)
    async def message_submitted(self, event: MessageSubmitted) -> None:
        if self.streaming:
            self.notify("A reply is still streaming; Esc stops it.", severity="warning")
            return
        if self.loading_model:
            self.notify(f"{self.loading_model} is still loading.", severity="warning")
            return
        if not self.tierchat.engine.model_name:  # before a conversation is made for it
            self.notify(
                "no model is loaded: F4 picks one; your message stays in the input.",
                title="Cannot generate",
                severity="error",
            )
            return
        if not self._ensure_conversation(event.text):
            return
        session = self.tierchat.session
        if await self.turns.start(lambda cb: session.send(event.text, on_event=cb)):
            self.query_one(ChatInput).clear()

    def _regenerate_target(self) -> MessageView | None:
        """The message whose user turn a regenerate answers again: the one under the
        cursor (a reply or its user message), else the last message."""
        views = self._views()
        if self.selected is not None and 0 <= self.selected < len(views):
            view = views[self.selected]
            if view.info.node_id is not None and view.info.role in ("user", "assistant"):
                return view
            return None
        if views and views[-1].info.role in ("user", "assistant") and views[-1].info.node_id:
            return views[-1]
        return None

    async def action_regenerate(self) -> None:
        """A new reply to the user turn of the message under the cursor (from the input:
        the last one), a sibling of the reply shown there; its prompt ends at that user
        message."""
        target = self._regenerate_target()
        if target is None or target.info.turn < 0:
            return
        session = self.tierchat.session
        settings = session.settings()
        turn = target.info.turn
        if settings.temperature == 0 and target.info.role == "assistant":
            swipe = settings.swipe_temperature
            self.notify(
                f"Temperature is 0: this regenerate samples at the swipe temperature {swipe:g} "
                "(F9 sets both)."
                if swipe > 0
                else "Temperature and swipe temperature are 0 (greedy): the new reply will "
                "match the old one. F9 sets them for this conversation.",
                timeout=5,
            )
        await self.turns.start(lambda cb: session.regenerate(turn=turn, on_event=cb))
        self.focus_input()

    def _continue_target(self) -> MessageView | None:
        """The reply a continue extends: the one under the cursor, else the last one;
        only a reply cut at max tokens or stopped, made by the loaded model."""
        target = self._regenerate_target()
        if target is None or target.info.role != "assistant" or target.info.node_id is None:
            return None
        metrics = target.info.metrics
        cut = metrics is not None and metrics.finish_reason in ("length", "cancelled")
        return target if cut and target.info.model == self.tierchat.engine.model_name else None

    async def action_continue_reply(self) -> None:
        """Generate more of a cut reply: its prompt + its ids, all in the resident cache
        (nothing prefilled); the whole reply becomes a new sibling (the cut one stays)."""
        target = self._continue_target()
        if target is None:
            return
        node_id, session = target.info.node_id, self.tierchat.session
        await self.turns.start(lambda cb: session.continue_reply(node_id, on_event=cb))
        self.focus_input()

    def action_edit(self) -> None:
        user = self._target_user()
        if user is None:
            return
        turn = user.info.turn

        async def done(text: str | None) -> None:
            if text is None:
                return
            session = self.tierchat.session
            await self.turns.start(lambda cb: session.edit(turn, text, on_event=cb))
            self.focus_input()

        self.app.push_screen(EditMessageScreen(user.info.content, turn), done)

    def action_stop(self) -> None:
        self.turns.stop()

    @on(PrefillAdvanced)
    def prefill_advanced(self, event: PrefillAdvanced) -> None:
        self.turns.prefill(event)

    @on(ReplyStreamed)
    async def reply_streamed(self, event: ReplyStreamed) -> None:
        await self.turns.streamed(event)

    @on(ReplyFinished)
    async def reply_finished(self, event: ReplyFinished) -> None:
        await self.turns.finished(event)

    @on(ReplyFailed)
    async def reply_failed(self, event: ReplyFailed) -> None:
        await self.turns.failed(event)

    def turn_ended(self) -> None:
        """After a reply finished or failed: refresh the list, the keys, the panels and
        the context the input's border shows."""
        self.refresh_conversations()
        self._show_selection()
        self.refresh_bindings()
        self.poll_stats()
        self.draft_meter.changed()

    # ------------------------------------------------------------------ branches

    async def action_swipe(self, delta: int) -> None:
        """Show the previous/next sibling of the message under the cursor (a reply, or a
        user message that edits made into branches)."""
        target = self._branch_target()
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
        ok, _ = self.attempt("Cannot show that branch", pick)
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
        self.focus_input()
        hint = " Ctrl+R generates its reply." if target.info.role == "user" else ""
        self.notify(f"Forked into “{self.sub_title.split(' · ')[-1]}”.{hint}")

    def action_copy(self) -> None:
        target = self._target()
        if target is None:
            return
        text = target.text
        self.app.copy_to_clipboard(text)
        self.notify(f"Copied {len(text)} characters of the {target.info.role} message.")

    def action_toggle_reasoning(self) -> None:
        target = self._target()
        if target is None:
            return
        if not target.has_reasoning:
            self.notify("This reply has no reasoning (<think>…</think>) to show.", timeout=3)
            return
        target.toggle_reasoning()

    def action_export(self, fmt: str = "md", scope: str = "path") -> None:
        """Write the open conversation (active path or whole tree) under the data dir."""
        from tierchat.tui.export import export_conversation, export_path

        cid = self.conversation_id
        if cid is None:
            return
        app = self.tierchat

        def write() -> Path:
            info = app.store.get_conversation(cid)
            saved = app.store.conversation_settings(cid)
            text = export_conversation(app.store, cid, fmt, scope, saved)  # type: ignore[arg-type]
            folder = Path(getattr(app.settings, "data_dir", ".")) / "exports"
            folder.mkdir(parents=True, exist_ok=True)
            path = export_path(folder, info.title or "", cid, fmt, scope)
            path.write_text(text)
            return path

        ok, path = self.attempt("Export failed", write)
        if ok:
            self.notify(str(path), title="Exported")

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
        if spec.startswith(("/", "./", "../", "~")):
            path = Path(os.path.expanduser(spec))
            if not path.is_dir():
                what = "no such directory" if not path.exists() else "not a directory"
                self.notify(f"{spec}: {what}", title=f"Cannot load {spec}", severity="error")
                return
        post = self.post_message

        def on_event(event: Event) -> None:
            if isinstance(event, ModelLoading):
                post(ModelLoadAdvanced(spec, event.done, event.total, event.message))
            elif isinstance(event, ModelLoaded):
                post(ModelLoadFinished(event.model, event.warning))
            elif isinstance(event, Failed):
                post(ModelLoadFailed(spec, event.message))

        self.loading_model = spec
        self.query_one(ActivityBar).show_loading(spec, 0, 0, "")
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
        others = sorted(
            {i.model for i in self.path_infos() if i.role == "assistant" and i.model}
            - {event.model}
        )
        if others:
            self.notify(
                f"This conversation holds replies of {', '.join(others)}; {event.model} reads "
                "them as its own. Ctrl+R regenerates the last reply, Ctrl+N starts afresh.",
                title="Another model's replies",
                severity="warning",
                timeout=8,
            )
        self.refresh_bindings()
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
        confirm_clear(self, tier, self.clear_tier)

    @work(thread=True, group="clear")
    def clear_tier(self, tier: str, request: dict | None = None) -> None:
        """Clear ``tier`` on the engine (no confirmation), then report it and refresh the
        panels. A thread worker: ``Engine.clear`` waits for the engine thread, which may be
        in the middle of a prefill chunk or a model load. ``request``: a clear asked for by
        ``tierchat cache clear`` (live_status.py), answered in the status file."""
        before = self._safe_stats()
        try:
            self.tierchat.engine.clear(tier)
        except Exception as e:  # noqa: BLE001 - reported on the UI thread below
            self.app.call_from_thread(self._clear_failed, tier, e, request)
        else:
            self.app.call_from_thread(self._cleared, tier, before, request)

    def _cleared(self, tier: str, before: CacheStats | None, request: dict | None) -> None:
        after = self._safe_stats()
        report = clear_report(tier, before, after)
        if request is not None and self._status is not None:
            self._status.served(request, report)
        self.poll_stats()
        title = "Cache cleared" + (" (from the command line)" if request else "")
        self.notify(report, title=title)

    def _clear_failed(self, tier: str, error: Exception, request: dict | None) -> None:
        text = str(error) or type(error).__name__
        if request is not None and self._status is not None:
            self._status.served(request, f"failed: {text}")
        self.notify(text, title=f"Clear {tier} failed", severity="error")
        self.poll_stats()

    def _safe_stats(self) -> CacheStats | None:
        try:
            return self.tierchat.engine.stats()
        except Exception:  # noqa: BLE001 - a failed poll shows stale panels, never a crash
            return None

    def poll_stats(self) -> CacheStats | None:
        """Read one stats snapshot into the panels (or the summary line), write it to the
        status file, serve clear requests from the CLI and raise alerts. Never raises."""
        stats = self._safe_stats()
        if stats is None:
            return None
        if self.panels_visible:
            self.query_one(CachePanels).stats = stats
        else:
            self.query_one(CacheSummary).stats = stats
        before, self._last_stats = self._last_stats, stats
        for severity, title, text in alerts(before, stats):
            self.notify(text, title=title, severity=severity, timeout=8)
        if self._status is not None:
            self._status.write(self.tierchat.engine.model_name, stats)
            for request in self._status.requests():
                if request["tier"] not in CACHE_TIERS:
                    self._status.served(request, f"unknown tier {request['tier']!r}")
                    continue
                if request["id"] not in self._serving:
                    self._serving.add(request["id"])
                    self.clear_tier(request["tier"], request)
        return stats

    def action_toggle_panels(self) -> None:
        self.panels_visible = not self.panels_visible

    def watch_panels_visible(self, visible: bool) -> None:
        self.set_class(visible, "-panels")
        if visible and self._last_stats is not None:
            self.query_one(CachePanels).stats = self._last_stats
        elif self._last_stats is not None:
            self.query_one(CacheSummary).stats = self._last_stats

    def action_toggle_conversations(self) -> None:
        listing = self.query_one(ConversationList)
        self.toggle_class("-no-list")
        if not self.has_class("-no-list"):
            listing.focus()
        else:
            self.focus_input()

    def on_unmount(self) -> None:
        self.turns.stop()
        if self._status is not None:
            self._status.remove()
