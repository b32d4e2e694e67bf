"""The chat transcript: one :class:`MessageView` per message of the active path.

The transcript is an anchored ``VerticalScroll`` (it follows the bottom while a reply
streams, until the user scrolls up). :meth:`Transcript.sync` diffs the shown messages with
the session's active path by node id, so a swipe or an edit only remounts what changed.

Focused, the transcript is a message cursor: ↑/↓ move it (visibly), ←/→ pick a sibling of
the message under it (a reply, or an edited user message), and single keys act on that
message. Plain keys, so they work in every terminal: the chat input is not focused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from textual import events, on
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.events import Click
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets.markdown import MarkdownStream
from tierchat.core.api import TurnMetrics
from tierchat.tui.format import fmt_metrics, metrics_from_meta, split_think, verify_line
from tierchat.tui.messages import BranchRequested, MessageClicked, PathShown, TypedInTranscript
from tierchat.tui.widgets.conversation_list import fmt_when
from tierchat.tui.widgets.tool_block import (
    CallRow,
    ToolCallBlock,
    ToolResultBlock,
    call_rows,
    result_name,
    result_state,
)


@dataclass(frozen=True)
class MessageInfo:
    """What one message shows. ``turn`` is the 0-based user turn on the active path;
    for a reply, ``index`` / ``count`` place it among its siblings (the swipe position).
    A reply's ``calls`` are its tool calls; a ``tool`` message (a call's result) names
    its ``tool`` (``server.tool``) and ``tool_state`` (``tui/widgets/tool_block.py``)."""

    node_id: int | None
    role: str
    content: str
    turn: int
    index: int = 0
    count: int = 1
    metrics: TurnMetrics | None = None
    model: str = ""
    verify: str = ""  # the reply verified against cold (core/chat/verify.py), one line
    created_at: float = 0.0  # epoch seconds; 0: not stored yet (a streaming reply)
    calls: tuple[CallRow, ...] = ()
    tool: str = ""
    tool_state: str = ""


FOLD_LINES = 16
"""A user or system message longer than this many lines shows its first FOLD_SHOWN."""
FOLD_SHOWN = 8


def fold_long(text: str) -> str:
    """``text``, or for a long paste its first :data:`FOLD_SHOWN` lines and a line saying
    how many more there are (``v`` shows the whole message; the model sees all of it)."""
    lines = text.split("\n")
    if len(lines) <= FOLD_LINES:
        return text
    more = len(lines) - FOLD_SHOWN
    return "\n".join(lines[:FOLD_SHOWN]) + f"\n… {more:,} more lines (v shows the whole message)"


def message_infos(entries: Sequence[Any], system: str | None = None) -> list[MessageInfo]:
    """The rows of a transcript from the store's ``active_path_entries`` (``node``,
    ``index``, ``count`` per message), O(n). ``system`` (the conversation's effective
    system prompt) replaces a system root, or is shown first when the tree has none.
    A ``tool`` node (a call's result) is a row of its own; the step that made the call
    shows it as a call block (docs/DESIGN.md §12.1)."""
    infos: list[MessageInfo] = []
    turn = -1
    named: dict[str, CallRow] = {}  # call id -> (server, tool, "") from its stored result
    for entry in entries:
        meta = entry.node.meta or {}
        if entry.node.role == "tool" and meta.get("server") and meta.get("tool"):
            named[str(meta.get("tool_call_id", ""))] = (meta["server"], meta["tool"], "")
    if system and not (entries and entries[0].node.role == "system"):
        infos.append(MessageInfo(0, "system", system, -1))
    for entry in entries:
        node = entry.node
        if node.role == "user":
            turn += 1
            infos.append(
                MessageInfo(
                    node.id, "user", node.content, turn, entry.index, entry.count,
                    created_at=node.created_at,
                )
            )  # fmt: skip
        elif node.role == "assistant":
            meta = node.meta or {}
            infos.append(
                MessageInfo(
                    node.id,
                    "assistant",
                    node.content,
                    turn,
                    entry.index,
                    entry.count,
                    metrics=metrics_from_meta(meta),
                    model=str(meta.get("model", "")),
                    verify=verify_line(meta),
                    created_at=node.created_at,
                    calls=call_rows(meta, named),
                )
            )
        elif node.role == "tool":
            meta = node.meta or {}
            infos.append(
                MessageInfo(
                    node.id, "tool", node.content, turn, entry.index, entry.count,
                    created_at=node.created_at, tool=result_name(meta),
                    tool_state=result_state(meta),
                )
            )  # fmt: skip
        elif system != "":
            content = node.content if system is None else system
            infos.append(MessageInfo(node.id, "system", content, -1, entry.index, entry.count))
    return infos


class BranchBar(Static):
    """``◀ 2/3 ▶ · ↻ regenerate · ⏵ continue · fork · copy`` (continue on a reply cut at max
    tokens or stopped); each part is a click action."""

    DEFAULT_CSS = """
    BranchBar { height: auto; color: $text-muted; }
    BranchBar:hover { color: $text; }
    """

    def __init__(self, node_id: int | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.node_id = node_id

    def action_branch(self, action: str) -> None:
        if self.node_id is not None:
            self.post_message(BranchRequested(self.node_id, action))

    def show(self, info: MessageInfo, *, last_turn: bool) -> None:
        self.node_id = info.node_id
        if info.node_id is None:
            self.update("")
            return
        parts: list[str] = []
        if info.role == "assistant" or info.count > 1:
            prev = "[@click=branch('prev')]◀[/]" if info.index > 0 else "[dim]◀[/]"
            nxt = "[@click=branch('next')]▶[/]" if info.index < info.count - 1 else "[dim]▶[/]"
            parts.append(f"{prev} {info.index + 1}/{info.count} {nxt}")
        if info.role == "assistant" and last_turn:
            parts.append("[@click=branch('regenerate')]↻ regenerate[/]")
        cut = info.metrics is not None and info.metrics.finish_reason in ("length", "cancelled")
        if info.role == "assistant" and cut:  # Alt+C: the reply grows in place
            parts.append("[@click=branch('continue')]⏵ continue[/]")
        if info.role == "user":
            parts.append("[@click=branch('edit')]✎ edit[/]")
        parts.append("[@click=branch('fork')]fork[/]")
        parts.append("[@click=branch('copy')]copy[/]")
        self.update(" · ".join(parts))


class MessageView(Vertical):
    """One message: a role line, the body, and for a reply its branch bar and metrics
    line. Replies stream into the markdown with ``Markdown.get_stream()``.

    Only a reply is Markdown. What the user typed (a message, a system prompt) is shown
    as typed: ``<br>``, ``2*3*4`` and the line breaks of a poem are text, not markup.

    A reply's ``<think>…</think>`` reasoning is shown apart, in a collapsed
    :class:`Collapsible` (``t`` on the message, or a click, toggles it); the body shows
    the answer only. The stored content keeps the reasoning: whether the next prompt does
    is the chat template's choice (``core/chat/prompts.py``).
    """

    DEFAULT_CSS = """
    MessageView {
        height: auto;
        padding: 0 1;
        margin: 0 0 1 0;
        border-left: outer $panel;
    }
    MessageView.-user { border-left: outer $primary; background: $boost; }
    MessageView.-assistant { border-left: outer $success; }
    MessageView.-system { border-left: outer $warning; color: $text-muted; }
    MessageView.-tool { border-left: outer $warning 60%; margin: 0 0 1 2; }
    MessageView.-selected { background: $primary 15%; }
    Transcript:focus-within MessageView.-selected {
        background: $primary 30%;
        border-left: outer $accent;
    }
    MessageView.-streaming { border-left: outer $accent; }
    MessageView > .role { height: 1; color: $text-muted; text-style: bold; }
    MessageView > Markdown { margin: 0; padding: 0; background: transparent; }
    MessageView > Static.message-body { height: auto; }
    .message-body > MarkdownBlock:last-child { margin-bottom: 0; }
    MessageView > .metrics { height: auto; color: $text-muted; }
    MessageView > Collapsible {
        background: transparent; border: none; padding: 0; margin: 0;
        color: $text-muted;
    }
    MessageView > Collapsible > Contents { padding: 0 0 0 2; height: auto; }
    MessageView > Collapsible .reasoning { color: $text-muted; text-style: italic; }
    """

    def __init__(self, info: MessageInfo, *, streaming: bool = False) -> None:
        super().__init__(classes=f"-{info.role}")
        self.info = info
        self._stream: MarkdownStream | None = None
        # a streaming reply mounted with its text so far (``info.content``) shows it at once
        self._shown_text = info.content if streaming else ""
        self._shown_answer = self._parts(info.content)[1] if streaming else ""
        self._last_turn = True
        self.set_class(streaming, "-streaming")

    def _parts(self, text: str) -> tuple[str | None, str, bool]:
        if self.info.role != "assistant":
            return None, text, True
        return split_think(text)

    def compose(self) -> ComposeResult:
        yield Static(self._role_line(), classes="role", markup=False)
        reasoning, answer, closed = self._parts(self.info.content)
        if reasoning is not None:
            yield self._think_box(reasoning, closed)
        if self.info.role == "assistant":
            yield Markdown(
                answer or ("…" if self.has_class("-streaming") else ""), classes="message-body"
            )
            for row in self.info.calls:
                yield ToolCallBlock(*row, classes="tool-call")
        elif self.info.role == "tool":
            state = self.info.tool_state or "ok"
            yield ToolResultBlock(answer, state, classes="message-body")  # type: ignore[arg-type]
        else:
            yield Static(fold_long(answer), classes="message-body", markup=False)
        if self.info.role in ("user", "assistant"):
            yield BranchBar(self.info.node_id, classes="branch-bar")
        if self.info.role == "assistant":
            yield Static("", classes="metrics", markup=False)

    @staticmethod
    def _think_title(reasoning: str, closed: bool) -> str:
        words = len(reasoning.split())
        return f"reasoning · {words} words" if closed else f"thinking… {words} words"

    def _think_box(self, reasoning: str, closed: bool) -> Collapsible:
        return Collapsible(
            Static(reasoning, classes="reasoning", markup=False),
            title=self._think_title(reasoning, closed),
            collapsed=True,
            classes="think",
        )

    async def _show_reasoning(self, reasoning: str | None, closed: bool) -> None:
        boxes = self.query_children(Collapsible)
        if reasoning is None:
            await boxes.remove()
            return
        if not boxes:
            await self.mount(self._think_box(reasoning, closed), before=self.markdown)
            return
        box = boxes.first()
        box.title = self._think_title(reasoning, closed)
        box.query_one(".reasoning", Static).update(reasoning)

    @property
    def has_reasoning(self) -> bool:
        return bool(self.query_children(Collapsible))

    def toggle_reasoning(self) -> bool:
        """Expand or collapse the reasoning; False when the message has none."""
        boxes = self.query_children(Collapsible)
        if not boxes:
            return False
        box = boxes.first()
        box.collapsed = not box.collapsed
        return True

    def on_mount(self) -> None:
        self._refresh_bars(last_turn=True)

    def on_click(self) -> None:
        self.post_message(MessageClicked(self))

    def _role_line(self) -> str:
        when = f" · {fmt_when(self.info.created_at)}" if self.info.created_at else ""
        if self.info.role == "user":
            return f"you{when}"
        if self.info.role == "system":
            return "system prompt"
        if self.info.role == "tool":
            return f"tool result · {self.info.tool}{when}"
        who = f"assistant · {self.info.model}" if self.info.model else "assistant"
        return who + when

    def _refresh_bars(self, *, last_turn: bool) -> None:
        self._last_turn = last_turn
        if self.info.role in ("user", "assistant"):
            self.query_one(BranchBar).show(self.info, last_turn=last_turn)
        if self.info.role == "assistant":
            metrics = self.info.metrics
            lines = [fmt_metrics(metrics)] if metrics else []
            lines += [self.info.verify] if self.info.verify else []
            self.query_one(".metrics", Static).update("\n".join(lines))

    @property
    def markdown(self) -> Markdown:
        """The body of a reply (a ``NoMatches`` error for a user or system message)."""
        return self.query_one(Markdown)

    @property
    def body(self) -> Markdown | Static | ToolResultBlock:
        """The widget showing the content: Markdown for a reply, a result block for a
        tool result, literal text otherwise."""
        kind = {"assistant": Markdown, "tool": ToolResultBlock}.get(self.info.role, Static)
        return self.query_one(".message-body", kind)

    @property
    def text(self) -> str:
        """What the message holds now (the content, or the streamed text so far)."""
        return self._shown_text if self.has_class("-streaming") else self.info.content

    async def _show_content(self, content: str) -> None:
        reasoning, answer, closed = self._parts(content)
        if self.info.role == "tool":
            self.query_one(ToolResultBlock).show(answer, self.info.tool_state or "ok")  # type: ignore[arg-type]
            return
        if self.info.role != "assistant":
            self.body.update(fold_long(answer))
            return
        await self._show_reasoning(reasoning, closed)
        await self.markdown.update(answer)

    async def update_info(self, info: MessageInfo, *, last_turn: bool) -> None:
        """Show ``info`` (same node, or a stored reply replacing a streamed one)."""
        if info == self.info and last_turn == self._last_turn:
            return
        changed = info.content != self.info.content or info.tool_state != self.info.tool_state
        calls_changed = info.calls != self.info.calls
        self.info = info
        self.query_one(".role", Static).update(self._role_line())
        if changed:
            await self._show_content(info.content)
        if calls_changed:
            await self.query_children(ToolCallBlock).remove()
            blocks = [ToolCallBlock(*row, classes="tool-call") for row in info.calls]
            if blocks:
                await self.mount_all(blocks, after=self.markdown)
        self._refresh_bars(last_turn=last_turn)

    def set_last_turn(self, last_turn: bool) -> None:
        if last_turn != self._last_turn:
            self._refresh_bars(last_turn=last_turn)

    # ------------------------------------------------------------------ streaming

    async def stream_to(self, text: str) -> None:
        """Extend the streamed body to ``text`` (the cumulative reply so far); reasoning
        goes to the collapsed box, the answer streams into the markdown."""
        self._shown_text = text
        reasoning, answer, closed = self._parts(text)
        if reasoning is not None:
            await self._show_reasoning(reasoning, closed)
        if not answer.startswith(self._shown_answer):
            # Decoding revised earlier text (rare): restart the stream from scratch.
            await self._stop_stream()
            self._shown_answer = ""
            await self.markdown.update("")
        delta = answer[len(self._shown_answer) :]
        if not delta:
            if reasoning is not None and not self._shown_answer and self._stream is None:
                await self.markdown.update("")  # drop the "…" placeholder
            return
        if self._stream is None:
            if not self._shown_answer:  # the "…" placeholder (else: the text mounted with)
                await self.markdown.update("")
            self._stream = Markdown.get_stream(self.markdown)
        self._shown_answer = answer
        await self._stream.write(delta)

    async def _stop_stream(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.stop()

    async def finish(self, info: MessageInfo) -> None:
        """Stop streaming and show the stored reply in full."""
        await self._stop_stream()
        self.set_class(False, "-streaming")
        self.info = info
        self._shown_text = ""
        self._shown_answer = ""
        self.query_one(".role", Static).update(self._role_line())
        await self._show_content(info.content)
        if info.calls:
            calls = [ToolCallBlock(*row, classes="tool-call") for row in info.calls]
            await self.mount_all(calls, after=self.markdown)
        self._refresh_bars(last_turn=True)


class EarlierMessages(Static):
    """ "▲ 160 earlier messages · click, or ↑ at the top" above the mounted window."""

    DEFAULT_CSS = """
    EarlierMessages { color: $text-muted; text-style: italic; padding: 0 1; display: none; }
    EarlierMessages.-some { display: block; }
    EarlierMessages:hover { color: $text; }
    """

    def show(self, hidden: int) -> None:
        self.set_class(hidden > 0, "-some")
        if hidden:
            self.update(f"▲ {hidden} earlier messages · click, or ↑ at the top, to show more")


class Transcript(VerticalScroll):
    """The messages of the active path, with a welcome note while empty.

    Focused, it is the message cursor (see the module docstring): the widget holding it
    (``screens/chat/pane.py``, ``MessagePane``) owns the cursor position and the actions
    on the message under it, and binds their keys; the arrow, Home and End keys are not
    scrolls here (:attr:`CURSOR_SCROLLS`), so they reach those bindings. A printable key
    that is not bound goes to the chat input.
    """

    DEFAULT_CSS = """
    Transcript { height: 1fr; padding: 0 1; scrollbar-size-vertical: 1; }
    Transcript:focus { background-tint: $foreground 3%; }
    Transcript > #welcome { color: $text-muted; padding: 1 2; width: 1fr; }
    Transcript.-has-messages > #welcome { display: none; }
    """

    CURSOR_SCROLLS: ClassVar[frozenset[str]] = frozenset(
        {"scroll_up", "scroll_down", "scroll_left", "scroll_right", "scroll_home", "scroll_end"}
    )
    """The scroll actions of the arrow, Home and End keys, which here move the message
    cursor instead (bound on the widget holding the transcript)."""

    WINDOW = 40
    """Messages mounted at most (the newest); older ones wait behind a "show earlier" line.

    Textual lays out every mounted widget of a scroll view on each refresh, so a
    transcript of n mounted messages costs O(n) per reply; a window keeps the per-reply
    refresh flat (scripts/transcript_bench.py)."""

    def __init__(self, *, welcome: str = "", id: str | None = None) -> None:
        super().__init__(id=id)
        self._welcome = welcome
        self._lock = asyncio.Lock()  # one sync / mount at a time
        self.window = self.WINDOW
        self.hidden = 0
        """Messages of the path not mounted (older than the window)."""
        self._infos: list[MessageInfo] = []

    def compose(self) -> ComposeResult:
        yield EarlierMessages("", id="earlier")
        yield Static(self._welcome, id="welcome")

    def on_mount(self) -> None:
        self.anchor()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.CURSOR_SCROLLS:
            return False  # the key moves the message cursor (the holder's binding)
        return super().check_action(action, parameters)

    def on_key(self, event: events.Key) -> None:
        # A printable key no binding takes (keymap applied) is typing: it goes to the input.
        if event.key in self.screen.active_bindings:
            return
        if event.is_printable and event.character:
            event.stop()
            event.prevent_default()
            self.post_message(TypedInTranscript(event.character))

    def set_welcome(self, text: str) -> None:
        self.query_one("#welcome", Static).update(text)

    @property
    def views(self) -> list[MessageView]:
        return list(self.query_children(MessageView))

    async def sync(
        self, infos: list[MessageInfo], streaming: MessageInfo | None = None
    ) -> MessageView | None:
        """Show exactly ``infos``: keep views whose node ids match, remount the rest;
        ``streaming``: a reply in flight after them (its text so far as content), mounted
        with the rest. Returns its view (None without one)."""
        async with self._lock:
            return await self._sync(infos, streaming)

    async def show_earlier(self, count: int | None = None) -> int:
        """Mount ``count`` (default :attr:`WINDOW`) more of the older messages; returns
        how many were added (at the top)."""
        async with self._lock:
            before = len(self.views)
            self.window += count or self.WINDOW
            await self._sync(self._infos)
            return len(self.views) - before

    @on(Click, "#earlier")
    async def _earlier_clicked(self) -> None:
        await self.show_earlier()

    async def _align_front(self, views: list[MessageView], visible: list[MessageInfo]):
        """Drop views older than the window, mount window messages older than the views."""
        if not views or not visible:
            return views
        ids = [v.info.node_id for v in views]
        first = visible[0].node_id
        if first is not None and first in ids and ids.index(first) > 0:
            cut = ids.index(first)
            await self.remove_children(views[:cut])
            return views[cut:]
        wanted = [i.node_id for i in visible]
        if ids[0] is not None and ids[0] in wanted and wanted.index(ids[0]) > 0:
            older = [MessageView(i) for i in visible[: wanted.index(ids[0])]]
            await self.mount_all(older, before=views[0])
            return older + views
        return views

    async def _sync(
        self, infos: list[MessageInfo], streaming: MessageInfo | None = None
    ) -> MessageView | None:
        ids = tuple(i.node_id for i in infos)
        if ids != tuple(i.node_id for i in self._infos):
            self.post_message(PathShown(ids))
        self._infos = list(infos)
        visible = infos[-self.window :] if len(infos) > self.window else list(infos)
        self.hidden = len(infos) - len(visible)
        earlier = self.query_one("#earlier", EarlierMessages)
        earlier.show(self.hidden)
        infos = visible
        views = await self._align_front(self.views, visible)
        keep = 0
        while (
            keep < len(views)
            and keep < len(infos)
            and views[keep].info.node_id is not None
            and views[keep].info.node_id == infos[keep].node_id
        ):
            keep += 1
        if views[keep:]:
            await self.remove_children(views[keep:])
        last_assistant = max(
            (i for i, info in enumerate(infos) if info.role == "assistant"), default=-1
        )
        for i, view in enumerate(views[:keep]):
            await view.update_info(infos[i], last_turn=i == last_assistant)
        new = [MessageView(info) for info in infos[keep:]]
        reply = MessageView(streaming, streaming=True) if streaming is not None else None
        if new or reply is not None:
            await self.mount_all([*new, *([reply] if reply is not None else [])])
            for offset, view in enumerate(new):
                view.set_last_turn(keep + offset == last_assistant)
        self.set_class(bool(infos) or reply is not None, "-has-messages")
        self.anchor()
        return reply

    async def add_streaming_reply(self, info: MessageInfo) -> MessageView:
        """Mount a row that is not stored yet after the messages (a tool call running:
        tui/screens/chat/tool_rounds.py); it streams like a reply."""
        view = MessageView(info, streaming=True)
        async with self._lock:
            await self.mount(view)
        self.set_class(True, "-has-messages")
        self.anchor()
        return view
