"""The chat screen's message cursor: which message an action means (pure functions of
the transcript's views and the cursor index ``selected``, None when the input has the
focus) and :class:`MessageCursor`, which moves it (docs/DESIGN.md §16).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tierchat.tui.widgets.transcript import MessageView, Transcript

if TYPE_CHECKING:
    from tierchat.tui.screens.chat import ChatScreen

BRANCH_ACTIONS: dict[str, str] = {
    "prev": "swipe(-1)",
    "next": "swipe(1)",
    "regenerate": "regenerate",
    "edit": "edit",
    "fork": "fork",
    "copy": "copy",
}
"""The screen action for each button of a message's branch bar."""


def target(views: Sequence[MessageView], selected: int | None) -> MessageView | None:
    """The message under the cursor, else the last message (never a placeholder)."""
    stored = [v for v in views if v.info.node_id is not None]
    if not stored:
        return None
    if selected is not None and 0 <= selected < len(views):
        view = views[selected]
        if view.info.node_id is not None:
            return view
    return stored[-1]


def branch_target(views: Sequence[MessageView], selected: int | None) -> MessageView | None:
    """The message whose siblings ←/→ move through: the one under the cursor (or, from
    the input, the last reply); none for a placeholder or the system prompt."""
    if selected is None:
        replies = [v for v in views if v.info.role == "assistant"]
        view = replies[-1] if replies else None
    else:
        view = target(views, selected)
    if view is None or view.info.node_id is None or view.info.role == "system":
        return None
    return view


def target_user(views: Sequence[MessageView], selected: int | None) -> MessageView | None:
    """The user message of the target: itself, or the nearest user message above it."""
    view = target(views, selected)
    if view is None or view.info.role == "user":
        return view
    for above in reversed(views[: list(views).index(view)]):
        if above.info.role == "user":
            return above
    return None


def regenerate_target(views: Sequence[MessageView], selected: int | None) -> MessageView | None:
    """The message whose user turn a regenerate answers again: the one under the cursor
    (a reply or its user message), else the last message."""
    if selected is not None and 0 <= selected < len(views):
        view = views[selected]
        if view.info.node_id is not None and view.info.role in ("user", "assistant"):
            return view
        return None
    if views and views[-1].info.role in ("user", "assistant") and views[-1].info.node_id:
        return views[-1]
    return None


def continue_target(
    views: Sequence[MessageView], selected: int | None, model: str
) -> MessageView | None:
    """The reply a continue extends: the one under the cursor, else the last one; only a
    reply cut at max tokens or stopped, made by ``model`` (the loaded one)."""
    view = regenerate_target(views, selected)
    if view is None or view.info.role != "assistant" or view.info.node_id is None:
        return None
    metrics = view.info.metrics
    cut = metrics is not None and metrics.finish_reason in ("length", "cancelled")
    return view if cut and view.info.model == model else None


def regenerate_note(settings: Any, role: str) -> str:
    """What a regenerate of a reply (``role`` "assistant") samples at when the
    conversation is greedy ("" otherwise): the swipe temperature, or the same reply."""
    if not settings.sampling.greedy or role != "assistant":
        return ""
    swipe = settings.swipe_temperature
    if swipe > 0:
        return (
            f"Temperature is 0: this regenerate samples at the swipe temperature {swipe:g} "
            "(F9 sets both)."
        )
    return (
        "Temperature and swipe temperature are 0 (greedy): the new reply will match the "
        "old one. F9 sets them for this conversation."
    )


class MessageCursor:
    """Moves the chat screen's ``selected`` over the transcript's views and shows it."""

    def __init__(self, chat: ChatScreen) -> None:
        self.chat = chat

    def _transcript(self) -> Transcript:
        return self.chat.query_one(Transcript)

    def show(self) -> None:
        """Mark the selected view (and scroll it into sight)."""
        views, selected = self._transcript().views, self.chat.selected
        for i, view in enumerate(views):
            on = selected is not None and i == selected
            if view.has_class("-selected") != on:
                view.set_class(on, "-selected")
        if selected is not None and 0 <= selected < len(views):
            views[selected].scroll_visible(animate=False)

    def move(self, delta: int) -> None:
        """Move by ``delta`` messages and put the focus in the transcript; past the top,
        mount older messages first."""
        chat, transcript = self.chat, self._transcript()
        views = transcript.views
        if not views:
            return
        if not transcript.has_focus:
            transcript.focus()
            if chat.selected is None:
                chat.selected = len(views) - 1  # the cursor starts on the newest message
                return
        current = len(views) - 1 if chat.selected is None else chat.selected
        if current + delta < 0 and transcript.hidden:
            chat.run_worker(self._show_earlier(current + delta), group="earlier", exclusive=True)
            return
        chat.selected = max(0, min(len(views) - 1, current + delta))

    async def _show_earlier(self, selected: int) -> None:
        """Mount older messages and keep the cursor on the message above the old top."""
        added = await self._transcript().show_earlier()
        self.chat.selected = max(0, selected + added)

    def edge(self, last: bool) -> None:
        views = self._transcript().views
        if views:
            self.chat.selected = len(views) - 1 if last else 0

    def clicked(self, view: MessageView) -> None:
        views = self._transcript().views
        if view in views:
            self._transcript().focus()
            self.chat.selected = views.index(view)

    def branch_action(self, node_id: int | None, button: str) -> str | None:
        """Put the cursor on message ``node_id``; the action its bar's ``button`` runs
        (None when the message is not shown or the button is unknown)."""
        ids = [v.info.node_id for v in self._transcript().views]
        if node_id not in ids:
            return None
        self.chat.selected = ids.index(node_id)
        return BRANCH_ACTIONS.get(button)
