"""The conversation list: every stored conversation, newest first; Enter opens one."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from textual.binding import Binding, BindingType
from textual.markup import escape
from textual.widgets import OptionList
from textual.widgets.option_list import Option
from tierchat.tui.messages import ConversationChosen


@dataclass(frozen=True)
class ConversationRow:
    """One line of the list: ``id``, ``title`` and a ``when`` epoch timestamp (seconds)."""

    id: int
    title: str
    when: float

    @classmethod
    def from_store(cls, item: Any) -> ConversationRow:
        """From whatever ``ConversationStore.list_conversations()`` yields (object or dict)."""

        def get(name: str, default: Any = None) -> Any:
            if isinstance(item, dict):
                return item.get(name, default)
            return getattr(item, name, default)

        when = get("updated_at") or get("created_at") or 0.0
        return cls(int(get("id")), str(get("title") or "untitled"), float(when))


def fmt_when(epoch: float) -> str:
    """A fixed-format UTC timestamp (no "5 min ago": snapshots must not depend on now)."""
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(epoch)) if epoch else ""


STREAMING_MARK = "… "
"""Before the title of a conversation whose reply is still streaming (the open one is
marked ``●`` in the column before)."""


class ConversationList(OptionList):
    """Option ids are conversation ids as strings; the open one is marked ``●``, one
    whose reply streams :data:`STREAMING_MARK` before its title."""

    DEFAULT_CSS = """
    ConversationList { height: 1fr; border: round $primary 40%; background: transparent; }
    ConversationList:focus { border: round $primary; }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("delete", "screen.delete_conversation", "Delete", id="delete_conversation"),
        Binding("u", "screen.undo_delete", "Undo delete", id="undo_delete_list", show=False),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Conversations"
        self.rows: list[ConversationRow] = []
        self.active_id: int | None = None
        self.streaming: frozenset[int] = frozenset()
        """Conversations whose reply streams (marked)."""

    def _prompt(self, row: ConversationRow) -> str:
        mark = "●" if row.id == self.active_id else " "
        stream = STREAMING_MARK if row.id in self.streaming else ""
        return f"{mark} {stream}{escape(row.title)}\n  [dim]{fmt_when(row.when)}[/]"

    def show(self, rows: Iterable[ConversationRow], active_id: int | None) -> None:
        """Replace the options, keeping the highlight on ``active_id`` when it is listed."""
        self.rows = list(rows)
        self.active_id = active_id
        self.clear_options()
        for row in self.rows:
            self.add_option(Option(self._prompt(row), id=str(row.id)))
        ids = [row.id for row in self.rows]
        if active_id in ids:
            self.highlighted = ids.index(active_id)
        self.border_subtitle = f"{len(self.rows)}"

    def mark_streaming(self, conversation_ids: Iterable[int]) -> None:
        """Mark the conversations whose reply streams (and unmark the others)."""
        streaming = frozenset(conversation_ids)
        changed, self.streaming = streaming ^ self.streaming, streaming
        for row in self.rows:
            if row.id in changed:
                self.replace_option_prompt(str(row.id), self._prompt(row))

    @property
    def highlighted_id(self) -> int | None:
        """The conversation under the highlight, if any."""
        if self.highlighted is None or not self.rows:
            return None
        return self.rows[self.highlighted].id

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id is not None:
            self.post_message(ConversationChosen(int(event.option.id)))
