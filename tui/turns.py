"""One generation's lifecycle in the TUI: start, prefill progress, stream, finish or fail.

``ChatScreen`` owns the widgets and the keys; :class:`TurnRunner` owns the request in
flight. The engine calls the ``on_event`` made by :meth:`TurnRunner.callback` on its own
thread; it only posts messages (``tierchat.tui.messages``). The screen's handlers for
those messages call back into the runner on the UI thread.

Order of events (core/api.py): the session stores and selects a finished reply, and the
handle is done, *before* the terminal event reaches the callback, so when
:class:`ReplyFinished` arrives the store already holds the reply and a new turn may start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from tierchat.tui.screens.chat import ChatScreen

FAILURE_TITLES: dict[str, str] = {
    "refused": "Prefill refused",
    "unsupported": "Model not supported",
    "load": "Model load failed",
    "cancelled": "Stopped",
    "error": "Engine error",
}
"""Notification titles by ``Failed.kind`` (core/api.py ``FailureKind``)."""


class TurnRunner:
    """The request in flight for one :class:`ChatScreen` (at most one at a time).

    ``key`` numbers the turns; messages of an older turn (a late token batch after a
    stop) are dropped by comparing keys.
    """

    def __init__(self, screen: ChatScreen) -> None:
        self.screen = screen
        self.key = 0
        self.handle: Any = None
        self.stream_view: MessageView | None = None
        self.prefix = ""  # a continue streams after the text of the reply it extends
        self._ready = asyncio.Event()
        self._ready.set()

    # ------------------------------------------------------------------ engine thread

    def callback(self, key: int) -> Callable[[Event], None]:
        """An ``on_event`` for the engine thread: events -> messages, nothing else."""
        parts: list[str] = []
        tokens = 0
        post = self.screen.post_message

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

    def stop(self) -> None:
        """Ask the engine to stop the turn; "stopping…" shows until its last event."""
        if self.handle is not None:
            self.handle.cancel()
            if not getattr(self.handle, "done", False):
                self.screen.query_one(ActivityBar).show_stopping()

    async def start(self, call: Callable[[Callable[[Event], None]], Any]) -> bool:
        """Run ``call(on_event)`` (a session call returning a turn handle) and mount the
        streaming reply. Returns False (with a notification) when the session refused.

        Actions run on the app's message pump, so the turn's first events may reach the
        screen before the placeholder is mounted; their handlers wait until it is.
        """
        self.key += 1
        self._ready = ready = asyncio.Event()
        try:
            return await self._start(call)
        finally:
            ready.set()

    async def _start(self, call: Callable[[Callable[[Event], None]], Any]) -> bool:
        screen = self.screen
        ok, handle = screen.attempt("Cannot generate", lambda: call(self.callback(self.key)))
        if not ok:
            return False
        self.handle = handle
        continued = getattr(handle, "continued", None)
        self.prefix = continued.content if continued is not None else ""
        screen.streaming = True
        screen.selected = None
        infos = screen.path_infos()
        user = getattr(handle, "user_node", None)
        if user is not None:
            ids = [i.node_id for i in infos]
            if user.id in ids:
                infos = infos[: ids.index(user.id) + 1]
        transcript = screen.query_one(Transcript)
        await transcript.sync(infos)
        turn = sum(1 for i in infos if i.role == "user") - 1
        model = screen.tierchat.engine.model_name
        placeholder = MessageInfo(None, "assistant", "", turn, model=model)
        self.stream_view = await transcript.add_streaming_reply(placeholder)
        return True

    def current(self, key: int) -> bool:
        return key == self.key

    def _stopping(self) -> bool:
        return bool(getattr(self.handle, "cancelled", False))

    def prefill(self, event: PrefillAdvanced) -> None:
        if self._stopping():
            return
        if self.current(event.turn_key) and self.screen.streaming and event.done < event.total:
            self.screen.query_one(ActivityBar).show_prefill(event.done, event.total, event.tps)

    async def streamed(self, event: ReplyStreamed) -> None:
        if not self.current(event.turn_key):
            return
        await self._ready.wait()
        if self.stream_view is None:
            return
        if not self._stopping():
            self.screen.query_one(ActivityBar).hide()
        first = not self.stream_view.text
        await self.stream_view.stream_to(self.prefix + event.text)
        if first:  # the engine's last-turn record is this turn's from its first token on
            self.screen.poll_stats()

    async def finished(self, event: ReplyFinished) -> None:
        """The session has stored (and selected) the reply: show it as stored."""
        if not self.current(event.turn_key):
            return
        await self._ready.wait()
        handle, self.handle = self.handle, None
        view, self.stream_view = self.stream_view, None
        screen = self.screen
        screen.query_one(ActivityBar).hide()
        reply = getattr(handle, "reply_node", None)
        infos = screen.path_infos()
        stored = bool(infos) and infos[-1].role == "assistant"
        if view is not None and stored and (reply is None or infos[-1].node_id == reply.id):
            await view.finish(infos[-1])
        await screen.query_one(Transcript).sync(infos)
        screen.streaming = False
        self._restore_unsent(handle, infos)
        if event.metrics.finish_reason == "cancelled":
            screen.notify("Generation stopped; the partial reply is kept.", timeout=3)
        screen.turn_ended()

    async def failed(self, event: ReplyFailed) -> None:
        """Nothing half is kept (the session dropped the turn): show the path as stored,
        give an unsent message back to the input, say what happened in words."""
        if not self.current(event.turn_key):
            return
        await self._ready.wait()
        handle, self.handle = self.handle, None
        self.stream_view = None
        screen = self.screen
        screen.query_one(ActivityBar).hide()
        infos = screen.path_infos()
        await screen.query_one(Transcript).sync(infos)
        screen.streaming = False
        self._restore_unsent(handle, infos)
        title = FAILURE_TITLES.get(event.kind, "Engine error")
        if event.kind == "cancelled":
            kept = event.kept_tokens
            what = f"{kept:,} tokens kept for a retry" if kept else "nothing was kept"
            screen.notify(f"Stopped during prefill; {what}.", title=title, timeout=4)
        else:
            screen.notify(event.message, title=title, severity="error", timeout=8)
        screen.turn_ended()

    def _restore_unsent(self, handle: Any, infos: list[MessageInfo]) -> None:
        """The session drops a user message whose turn failed; give its text back."""
        user = getattr(handle, "user_node", None)
        if user is None or getattr(handle, "kind", "") not in ("send", "edit"):
            return
        if any(i.node_id == user.id for i in infos):
            return
        box = self.screen.query_one(ChatInput)
        if not box.text.strip():
            box.load_text(user.content)
