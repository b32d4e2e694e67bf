"""Which message an action on the chat screen means: the message cursor's rules, as
pure functions of the transcript's views and the cursor index (``selected``; None when
the input has the focus). docs/DESIGN.md §16.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierchat.tui.widgets.transcript import MessageView


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
