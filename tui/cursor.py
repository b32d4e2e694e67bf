"""The chat's message cursor: which message an action means, as pure functions of the
transcript's views and the cursor index ``selected`` (None when the input has the focus);
the cursor itself is ``MessagePane.selected`` (``screens/chat/pane.py``; docs/DESIGN.md
§16).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tierchat.tui.widgets.transcript import MessageView

BRANCH_ACTIONS: dict[str, str] = {
    "prev": "swipe(-1)",
    "next": "swipe(1)",
    "regenerate": "regenerate",
    "continue": "continue_reply",
    "edit": "edit",
    "fork": "fork",
    "copy": "copy",
}
"""The message pane's action for each button of a message's branch bar."""


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
