"""The live token count of the message being typed, in the chat input's bottom border:
``12 tokens · prompt 1,310 / 32,768 (4%)``; with an empty input, the context the
conversation uses: ``context 1,298 / 32,768 (4%)``.

Counting tokenizes (the prompt builder renders the template and encodes the draft: up to
~100 ms on a long conversation), so it is debounced (:data:`DEBOUNCE_S` after the last
keystroke) and runs in a thread worker, never on the UI thread. The count follows the
draft and the path on screen: the transcript says when it shows another path (a swipe, an
edit, a stored reply, another conversation: ``PathShown``), and a count started before the
latest change of either is dropped. Only the tokenizer object is used
(core/chat/draft.py): no MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.timer import Timer
from tierchat.core.chat.draft import DraftCount, count_draft

if TYPE_CHECKING:
    from textual.widget import Widget
    from tierchat.tui.widgets.chat_input import ChatInput

DEBOUNCE_S = 0.3
"""Seconds of no typing before the draft is counted."""

NEAR_LIMIT = 0.9
"""Fraction of the context from which the count shows as a warning."""


def meter_text(count: DraftCount, empty: bool = False) -> str:
    """What the input's border shows for ``count``; ``empty``: the input is empty, so
    the line says how much of the context the conversation already uses."""
    if empty:
        if not count.context_length:
            return f"context {count.prompt_tokens:,} tokens"
        pct = round(100 * (count.fraction or 0.0))
        return f"context {count.prompt_tokens:,} / {count.context_length:,} ({pct}%)"
    text = f"{count.text_tokens:,} token{'s' if count.text_tokens != 1 else ''}"
    if count.context_length:
        pct = round(100 * (count.fraction or 0.0))
        text += f" · prompt {count.prompt_tokens:,} / {count.context_length:,} ({pct}%)"
        if count.over:
            text += " · over the context"
    else:
        text += f" · prompt {count.prompt_tokens:,}"
    return text


class DraftMeter:
    """Counts the draft of the chat input ``box`` and shows it in the input's border
    subtitle, with class ``-near-limit`` / ``-over-limit`` on the input. ``node`` (the
    widget holding the input) runs the timer and the counting worker; the session is the
    app's."""

    def __init__(self, node: Widget, box: ChatInput) -> None:
        self.node = node
        self.box = box
        self.count: DraftCount | None = None
        """The last count shown (None: none shown)."""
        self._timer: Timer | None = None
        self._empty = False  # the count shown is the context of an empty input
        self._changes = 0  # changes of the draft or the path so far; a count carries its own
        self._path: tuple[int | None, ...] = ()

    def path_shown(self, node_ids: tuple[int | None, ...]) -> None:
        """The transcript shows the path ``node_ids`` now: count again. The figure shown
        is wrong at once unless the path only grew (a reply added to it)."""
        old, self._path = self._path, node_ids
        if node_ids[: len(old)] != old and self.count is not None:
            self.show(None)
        self.changed()

    def changed(self) -> None:
        """The draft changed: count it once the typing pauses."""
        self._changes += 1
        if self._timer is not None:
            self._timer.stop()
        if not self.box.text.strip() and self.count is not None and not self._empty:
            self.show(None)  # a draft's count is wrong at once; the context comes next
        self._timer = self.node.set_timer(DEBOUNCE_S, self.start)

    def start(self) -> None:
        """Count the current draft in a thread worker (replacing one in flight); an empty
        input counts the conversation as the next prompt would hold it."""
        text = self.box.text
        if not text.strip():
            text = ""
        app = self.node.app
        session = app.session  # type: ignore[attr-defined]
        change = self._changes

        def work() -> None:
            try:
                count = count_draft(session, text)
            except Exception:  # noqa: BLE001 - no count (no model, a template error)
                count = None
            app.call_from_thread(self._counted, change, text, count)

        self.node.run_worker(work, thread=True, exclusive=True, group="draft-count")

    def _counted(self, change: int, text: str, count: DraftCount | None) -> None:
        if change == self._changes:  # neither the draft nor the path changed since
            self.show(count, empty=not text)

    def show(self, count: DraftCount | None, empty: bool = False) -> None:
        self.count, self._empty = count, empty
        box = self.box
        box.border_subtitle = meter_text(count, empty) if count is not None else ""
        fraction = count.fraction if count is not None else None
        over = count is not None and count.over
        box.set_class(over, "-over-limit")
        box.set_class(not over and fraction is not None and fraction >= NEAR_LIMIT, "-near-limit")
