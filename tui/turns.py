"""The replies in flight in the TUI: start, prefill progress, stream, finish or fail,
one turn per conversation at a time, several conversations at once (docs/DESIGN.md §16).

The chat's message pane (``screens/chat/pane.py``, ``MessagePane``) owns the widgets
and the keys; :class:`TurnRunner` owns the turns in flight and the reply stream of the
conversation shown: each turn's text and the placeholder view it streams into. It
reaches the pane only through :class:`TurnHost`. The engine calls the ``on_event`` made
by :meth:`TurnRunner.callback` on its own thread; it only posts messages
(``tierchat.tui.messages``) to the pane, which hands them to the runner on the UI thread.

A turn of a conversation not shown goes on: its text is kept here, and when its
conversation is opened again the placeholder is mounted with the text so far. Esc stops
the turn of the conversation shown.

Order of events (core/api.py): the session stores and selects a finished reply, and the
handle is done, *before* the terminal event reaches the callback, so when
:class:`ReplyFinished` arrives the store already holds the reply and a new turn of that
conversation may start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from textual.message import Message
from tierchat.core.api import Event, Failed, Finished, PrefillProgress, TokenBatch
from tierchat.tui.messages import (
    PrefillAdvanced,
    ReplyFailed,
    ReplyFinished,
    ReplyStreamed,
)
from tierchat.tui.widgets.activity import ActivityBar
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.transcript import MessageInfo, MessageView, Transcript

FAILURE_TITLES: dict[str, str] = {
    "refused": "Prefill refused",
    "unsupported": "Model not supported",
    "load": "Model load failed",
    "cancelled": "Stopped",
    "error": "Engine error",
}
"""Notification titles by ``Failed.kind`` (core/api.py ``FailureKind``)."""

SessionCall = Callable[[Callable[[Event], None]], Any]
"""A session call given the ``on_event`` to use, returning a turn handle."""


class TurnHost(Protocol):
    """What :class:`TurnRunner` needs of the widget holding the transcript."""

    @property
    def conversation_id(self) -> int | None:
        """The conversation shown."""

    @property
    def model_name(self) -> str:
        """The loaded model's name (the placeholder's model line)."""

    def widgets(self) -> tuple[Transcript, ActivityBar, ChatInput]:
        """The transcript, the activity bar and the input of the conversation shown."""

    def path_infos(self, conversation_id: int | None = None) -> list[MessageInfo]:
        """The active path of ``conversation_id`` (default: the one shown)."""

    def post_message(self, message: Message) -> bool: ...

    def notify(self, message: str, *, title: str = "", severity: Any = ..., timeout: Any = ...):
        """A toast (plain text)."""

    def in_background(self, title: str, call: Callable[[], Any]) -> Awaitable[tuple[bool, Any]]:
        """Run ``call`` off the UI loop, in order with the other store writes;
        ``(False, None)`` after an error notification titled ``title``."""

    def turns_changed(self, *, ended: bool, first_token: bool = False) -> None:
        """A turn started or ended (``ended``), or streamed its first token."""

    def held_calls(self, handle: Any) -> Any:
        """A :class:`~tierchat.core.chat.tool_calls.HeldCalls` for the turn ``handle``
        (its tool calls held back while it streams), or None (no tools)."""

    def message_withdrawn(self, conversation_id: int, text: str) -> None:
        """The session dropped the user message ``text`` of ``conversation_id`` (its turn
        failed, or stopped before its first token)."""


@dataclass
class Turn:
    """One reply in flight: its conversation, its handle and the text streamed so far."""

    key: int
    conversation_id: int
    handle: Any = None
    prefix: str = ""  # a continue streams after the text of the reply it extends
    text: str = ""  # as the model wrote it so far
    shown: str = ""  # what the placeholder shows of it: its tool calls held back
    held: Any = None  # the HeldCalls that makes ``shown`` (None: no tools, all shown)
    view: MessageView | None = None  # the placeholder while its conversation is shown
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    stop_asked: bool = False  # a stop came before the handle: it is cancelled on arrival

    @property
    def stopping(self) -> bool:
        return self.stop_asked or bool(getattr(self.handle, "cancelled", False))


class TurnRunner:
    """The turns in flight for one message pane, at most one per conversation.

    ``key`` numbers the turns; messages of a turn no longer in flight (a late token
    batch after a stop) are dropped.
    """

    def __init__(self, host: TurnHost) -> None:
        self.host = host
        self.key = 0
        self.turns: dict[int, Turn] = {}  # by conversation id
        self._by_key: dict[int, Turn] = {}
        self._unsent: dict[int, str] = {}  # dropped messages of conversations not shown

    # ------------------------------------------------------------------ engine thread

    def callback(self, key: int) -> Callable[[Event], None]:
        """An ``on_event`` for the engine thread: events -> messages, nothing else."""
        parts: list[str] = []
        tokens = 0
        post = self.host.post_message

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
                post(ReplyFailed(key, event.message, event.kind, event.kept_tokens))

        return on_event

    # ------------------------------------------------------------------ UI thread

    def streaming(self, conversation_id: int | None) -> bool:
        """A turn of ``conversation_id`` is in flight."""
        return conversation_id is not None and conversation_id in self.turns

    @property
    def stream_view(self) -> MessageView | None:
        """The placeholder the shown conversation's reply streams into, if any."""
        turn = self.shown()
        return self._shown_view(turn) if turn is not None else None

    def shown(self) -> Turn | None:
        """The turn of the conversation shown, if one is in flight."""
        cid = self.host.conversation_id
        return self.turns.get(cid) if cid is not None else None

    def stop(self) -> None:
        """Ask the engine to stop the turn of the conversation shown; "stopping…" shows
        until its last event."""
        turn = self.shown()
        if turn is not None:
            self._cancel(turn, show=True)

    def stop_all(self) -> None:
        """Stop every turn (the screen goes away)."""
        for turn in list(self.turns.values()):
            self._cancel(turn, show=False)

    def _cancel(self, turn: Turn, *, show: bool) -> None:
        if turn.handle is None:
            # the session call is still on its way (a key pressed right after Enter): the
            # handle is cancelled the moment it is back (:meth:`start`), never dropped
            turn.stop_asked = True
            if show:
                self.host.widgets()[1].show_stopping()
            return
        turn.handle.cancel()
        if show and not getattr(turn.handle, "done", False):
            self.host.widgets()[1].show_stopping()

    async def start(self, conversation_id: int, call: SessionCall) -> bool:
        """Run ``call(on_event)`` (a session call returning a turn handle) off the UI loop
        and mount the streaming reply when ``conversation_id`` is still shown. Returns
        False (with a notification) when the session refused.

        The turn's first events may reach the screen before the handle is back; their
        handlers wait until it is (``Turn.ready``).
        """
        self.key += 1
        turn = Turn(self.key, conversation_id)
        self.turns[conversation_id] = self._by_key[turn.key] = turn
        self.host.turns_changed(ended=False)
        try:
            on_event = self.callback(turn.key)
            ok, handle = await self.host.in_background("Cannot generate", lambda: call(on_event))
            if not ok:
                self._drop(turn)
                self.host.turns_changed(ended=True)
                return False
            turn.handle = handle
            if turn.stop_asked:
                handle.cancel()
            turn.held = self.host.held_calls(handle)
            continued = getattr(handle, "continued", None)
            turn.prefix = continued.content if continued is not None else ""
            if self.host.conversation_id == conversation_id:
                await self.attach(self.host.path_infos())
            return True
        finally:
            turn.ready.set()

    def visible(self, infos: list[MessageInfo]) -> list[MessageInfo]:
        """The active path shown while the shown conversation's turn is in flight: up to
        the user message answered (a regenerate's old reply is not shown under it)."""
        turn = self.shown()
        user = getattr(turn.handle, "user_node", None) if turn is not None else None
        if user is not None:
            ids = [i.node_id for i in infos]
            if user.id in ids:
                return infos[: ids.index(user.id) + 1]
        return infos

    async def attach(self, infos: list[MessageInfo]) -> None:
        """Show the conversation shown as it stands: its path (:meth:`visible`) and, when
        its turn is in flight, the placeholder with the text streamed so far, mounted
        with the path's messages (not after them: no frame shows the path without it)."""
        transcript, _, box = self.host.widgets()
        infos = self.visible(infos)
        turn = self.shown()
        placeholder = None
        if turn is not None and turn.handle is not None:  # mounted with the path, its text
            number = sum(1 for i in infos if i.role == "user") - 1  # so far in it: at once
            text = turn.prefix + turn.shown if turn.text else ""
            placeholder = MessageInfo(None, "assistant", text, number, model=self.host.model_name)
        view = await transcript.sync(infos, placeholder)
        if turn is not None and view is not None:
            turn.view = view
        cid = self.host.conversation_id
        unsent = self._unsent.pop(cid, None) if cid is not None else None
        if unsent is not None and not box.text.strip():
            box.load_text(unsent)

    def _drop(self, turn: Turn) -> None:
        if self.turns.get(turn.conversation_id) is turn:
            del self.turns[turn.conversation_id]
        self._by_key.pop(turn.key, None)

    async def _turn(self, key: int) -> Turn | None:
        turn = self._by_key.get(key)
        if turn is not None:
            await turn.ready.wait()
        return turn if self._by_key.get(key) is turn else None

    def _shown_view(self, turn: Turn) -> MessageView | None:
        """The turn's placeholder when its conversation is the one shown (a placeholder
        removed by a switch to another conversation is not)."""
        if self.host.conversation_id != turn.conversation_id or turn.view is None:
            return None
        return turn.view if turn.view in self.host.widgets()[0].views else None

    async def prefill(self, event: PrefillAdvanced) -> None:
        turn = await self._turn(event.turn_key)
        if turn is None or turn.stopping or self.host.conversation_id != turn.conversation_id:
            return
        if event.done < event.total:
            self.host.widgets()[1].show_prefill(event.done, event.total, event.tps)

    async def streamed(self, event: ReplyStreamed) -> None:
        turn = await self._turn(event.turn_key)
        if turn is None:
            return
        first = not turn.text
        delta = event.text[len(turn.text) :]  # the text so far, so it only grows
        turn.text = event.text
        turn.shown += turn.held.feed(delta) if turn.held is not None else delta
        view = self._shown_view(turn)
        if view is None:
            return
        if not turn.stopping:
            self.host.widgets()[1].hide()
        await view.stream_to(turn.prefix + turn.shown)
        if first:  # the engine's last-turn record is this turn's from its first token on
            self.host.turns_changed(ended=False, first_token=True)

    async def finished(self, event: ReplyFinished) -> Turn | None:
        """The session has stored (and selected) the reply: show it as stored. Returns
        the turn (None for one no longer in flight)."""
        turn = await self._turn(event.turn_key)
        if turn is None:
            return None
        self._drop(turn)
        view = self._shown_view(turn)
        if view is not None:
            transcript, activity, _ = self.host.widgets()
            activity.hide()
            reply = getattr(turn.handle, "reply_node", None)
            infos = self.host.path_infos()
            stored = bool(infos) and infos[-1].role == "assistant"
            if stored and (reply is None or infos[-1].node_id == reply.id):
                await view.finish(infos[-1])
            await transcript.sync(self.visible(infos))
            if event.metrics.finish_reason == "cancelled":
                self.host.notify("Generation stopped; the partial reply is kept.", timeout=3)
        self._restore_unsent(turn)
        self.host.turns_changed(ended=True)
        return turn

    async def failed(self, event: ReplyFailed) -> None:
        """Nothing half is kept (the session dropped the turn): show the path as stored,
        give an unsent message back to the input, say what happened in words."""
        turn = await self._turn(event.turn_key)
        if turn is None:
            return
        self._drop(turn)
        shown = self.host.conversation_id == turn.conversation_id
        if shown:
            transcript, activity, _ = self.host.widgets()
            activity.hide()
            await transcript.sync(self.visible(self.host.path_infos()))
        self._restore_unsent(turn)
        title = FAILURE_TITLES.get(event.kind, "Engine error")
        if event.kind == "cancelled":
            kept = event.kept_tokens
            what = f"{kept:,} tokens kept for a retry" if kept else "nothing was kept"
            self.host.notify(f"Stopped during prefill; {what}.", title=title, timeout=4)
        else:
            self.host.notify(event.message, title=title, severity="error", timeout=8)
        self.host.turns_changed(ended=True)

    def _restore_unsent(self, turn: Turn) -> None:
        """The session drops a user message whose turn failed (or stopped before its
        first token); give its text back to the input: now when its conversation is
        shown, else when it is opened again."""
        handle = turn.handle
        user = getattr(handle, "user_node", None)
        if user is None or getattr(handle, "kind", "") not in ("send", "edit"):
            return
        if any(i.node_id == user.id for i in self.host.path_infos(turn.conversation_id)):
            return
        self.host.message_withdrawn(turn.conversation_id, user.content)
        if self.host.conversation_id != turn.conversation_id:
            self._unsent[turn.conversation_id] = user.content
            return
        box = self.host.widgets()[2]
        if not box.text.strip():
            box.load_text(user.content)
