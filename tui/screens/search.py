"""Search the stored messages (FTS5, ``ConversationStore.search``): in the open
conversation or in all of them. Results update as the user types; Enter (or a click)
dismisses with the chosen message's node id, which the chat screen opens at.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import Option
from tierchat.core.chat.search import SearchHit
from tierchat.core.units import fmt_count
from tierchat.tui.widgets.conversation_list import fmt_when

SearchScope = Literal["here", "all"]

ROLE_NAMES = {
    "user": "you",
    "assistant": "assistant",
    "system": "system prompt",
    "tool": "tool result",
}


def hit_place(hit: SearchHit) -> str:
    """Which message a hit is, enough to tell siblings apart: role, its place among its
    siblings (a reply's swipe, a message's edit) when it has any, its length and time:
    ``"assistant · swipe 2/2 · 57 tokens · 2026-11-20 14:03"``."""
    parts = [ROLE_NAMES.get(hit.role, hit.role)]
    if hit.count > 1:
        kind = "swipe" if hit.role == "assistant" else "edit"
        parts.append(f"{kind} {hit.index + 1}/{hit.count}")
    if hit.n_tokens is not None:
        parts.append(f"{fmt_count(hit.n_tokens)} token{'' if hit.n_tokens == 1 else 's'}")
    else:
        parts.append(f"{fmt_count(hit.n_chars)} char{'' if hit.n_chars == 1 else 's'}")
    parts.append(fmt_when(hit.created_at))
    return " · ".join(parts)


def hit_content(hit: SearchHit, *, with_title: bool) -> Content:
    """Two lines: where the message is (conversation, :func:`hit_place`) and its snippet
    with the matched words in bold."""
    where = hit_place(hit)
    head = Content(f"{hit.title} · {where}" if with_title else where).stylize("dim")
    body = Content(hit.snippet)
    for start, end in hit.marks:
        body = body.stylize("bold $accent", start, end)
    return Content("\n").join([head, body])


class SearchScreen(ModalScreen[int | None]):
    """Type words; ↑/↓ pick a result; Enter opens it (dismisses with its node id); Ctrl+T
    switches between this conversation and all; Esc cancels (None).

    Args:
        store: the ``ConversationStore`` to search.
        conversation_id: the open conversation (None: only "all" is offered).
        scope: where to search first.
        limit: results shown at most.
    """

    CSS_PATH = "search.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="search_cancel"),
        Binding("ctrl+t", "toggle_scope", "This chat / all", id="search_scope"),
        Binding("down", "move(1)", "Next result", id="search_next", show=False),
        Binding("up", "move(-1)", "Previous result", id="search_prev", show=False),
    ]

    def __init__(
        self,
        store: Any,
        conversation_id: int | None,
        scope: SearchScope = "here",
        *,
        query: str = "",
        limit: int = 50,
    ) -> None:
        super().__init__()
        self.store = store
        self.conversation_id = conversation_id
        self.scope: SearchScope = scope if conversation_id is not None else "all"
        self.query_text = query
        self.limit = limit
        self.hits: list[SearchHit] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog") as dialog:
            dialog.border_title = "Search messages"
            yield Input(self.query_text, placeholder="Words to find…", id="search-input")
            yield Static("", id="search-status", markup=False)
            yield OptionList(id="search-results")
            yield Static(
                "↑↓ pick · Enter open · Ctrl+T this chat / all · Esc cancel", classes="hint"
            )

    def on_mount(self) -> None:
        box = self.query_one(Input)
        box.cursor_blink = not self.app.is_headless
        box.focus()
        self.run_search()

    def _scope_title(self) -> str:
        return "this conversation" if self.scope == "here" else "all conversations"

    def run_search(self) -> None:
        """Search for the input's text now and show the hits (errors as the status)."""
        text = self.query_one(Input).value
        results = self.query_one(OptionList)
        status = self.query_one("#search-status", Static)
        cid = self.conversation_id if self.scope == "here" else None
        try:
            self.hits = self.store.search(text, conversation_id=cid, limit=self.limit)
        except Exception as e:  # noqa: BLE001 - a store error is a status line, not a crash
            self.hits = []
            status.update(f"Search failed: {e}")
            results.clear_options()
            return
        results.clear_options()
        results.add_options(
            Option(hit_content(h, with_title=self.scope == "all"), id=str(h.node_id))
            for h in self.hits
        )
        if self.hits:
            results.highlighted = 0
        where = self._scope_title()
        if not text.strip():
            status.update(f"In {where}: type a word.")
        elif not self.hits:
            status.update(f"In {where}: no message holds “{text.strip()}”.")
        else:
            more = "+" if len(self.hits) >= self.limit else ""
            n = len(self.hits)
            status.update(f"In {where}: {n}{more} message{'s' if n != 1 or more else ''}.")

    @on(Input.Changed, "#search-input")
    def _changed(self) -> None:
        self.run_search()

    @on(Input.Submitted, "#search-input")
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._choose(self.query_one(OptionList).highlighted)

    @on(OptionList.OptionSelected, "#search-results")
    def _selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self._choose(event.option_index)

    def _choose(self, index: int | None) -> None:
        if index is not None and 0 <= index < len(self.hits):
            self.dismiss(self.hits[index].node_id)

    def action_move(self, delta: int) -> None:
        results = self.query_one(OptionList)
        if not self.hits:
            return
        current = results.highlighted if results.highlighted is not None else -delta
        results.highlighted = max(0, min(len(self.hits) - 1, current + delta))

    def action_toggle_scope(self) -> None:
        if self.conversation_id is None:
            self.notify("No conversation is open: searching all of them.", timeout=3)
            return
        self.scope = "all" if self.scope == "here" else "here"
        self.run_search()

    def action_cancel(self) -> None:
        self.dismiss(None)
