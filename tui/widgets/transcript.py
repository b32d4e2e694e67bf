"""The chat transcript: one :class:`MessageView` per message of the active path.

The transcript is an anchored ``VerticalScroll`` (it follows the bottom while a reply
streams, until the user scrolls up). :meth:`Transcript.sync` diffs the shown messages with
the session's active path by node id, so a swipe or an edit only remounts what changed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream
from tierchat.core.api import TurnMetrics
from tierchat.tui.format import fmt_metrics
from tierchat.tui.messages import BranchRequested, MessageClicked


@dataclass(frozen=True)
class MessageInfo:
    """What one message shows. ``turn`` is the 0-based user turn on the active path;
    for a reply, ``index`` / ``count`` place it among its siblings (the swipe position)."""

    node_id: int | None
    role: str
    content: str
    turn: int
    index: int = 0
    count: int = 1
    metrics: TurnMetrics | None = None
    model: str = ""


class BranchBar(Static):
    """``◀ 2/3 ▶ · ↻ regenerate · fork · copy``; each part is a click action."""

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
        if info.role == "assistant":
            prev = "[@click=branch('prev')]◀[/]" if info.index > 0 else "[dim]◀[/]"
            nxt = "[@click=branch('next')]▶[/]" if info.index < info.count - 1 else "[dim]▶[/]"
            parts.append(f"{prev} {info.index + 1}/{info.count} {nxt}")
            if last_turn:
                parts.append("[@click=branch('regenerate')]↻ regenerate[/]")
        else:
            parts.append("[@click=branch('edit')]✎ edit[/]")
        parts.append("[@click=branch('fork')]fork[/]")
        parts.append("[@click=branch('copy')]copy[/]")
        self.update(" · ".join(parts))


class MessageView(Vertical):
    """One message: a role line, the markdown body, and for a reply its branch bar and
    metrics line. Replies stream into the markdown with ``Markdown.get_stream()``."""

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
    MessageView.-selected { background: $primary 15%; }
    MessageView.-streaming { border-left: outer $accent; }
    MessageView > .role { height: 1; color: $text-muted; text-style: bold; }
    MessageView > Markdown { margin: 0; padding: 0; background: transparent; }
    MessageView > Markdown > *:last-child { margin-bottom: 0; }
    MessageView > .metrics { height: auto; color: $text-muted; }
    """

    def __init__(self, info: MessageInfo, *, streaming: bool = False) -> None:
        super().__init__(classes=f"-{info.role}")
        self.info = info
        self._stream: MarkdownStream | None = None
        self._shown_text = ""
        self._last_turn = True
        self.set_class(streaming, "-streaming")

    def compose(self) -> ComposeResult:
        yield Static(self._role_line(), classes="role", markup=False)
        yield Markdown(self.info.content or ("…" if self.has_class("-streaming") else ""))
        if self.info.role in ("user", "assistant"):
            yield BranchBar(self.info.node_id, classes="branch-bar")
        if self.info.role == "assistant":
            yield Static("", classes="metrics", markup=False)

    def on_mount(self) -> None:
        self._refresh_bars(last_turn=True)

    def on_click(self) -> None:
        self.post_message(MessageClicked(self))

    def _role_line(self) -> str:
        if self.info.role == "user":
            return "you"
        if self.info.role == "system":
            return "system prompt"
        return f"assistant · {self.info.model}" if self.info.model else "assistant"

    def _refresh_bars(self, *, last_turn: bool) -> None:
        self._last_turn = last_turn
        if self.info.role in ("user", "assistant"):
            self.query_one(BranchBar).show(self.info, last_turn=last_turn)
        if self.info.role == "assistant":
            metrics = self.info.metrics
            self.query_one(".metrics", Static).update(fmt_metrics(metrics) if metrics else "")

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    @property
    def text(self) -> str:
        """What the body shows now (the content, or the streamed text so far)."""
        return self._shown_text if self.has_class("-streaming") else self.info.content

    async def update_info(self, info: MessageInfo, *, last_turn: bool) -> None:
        """Show ``info`` (same node, or a stored reply replacing a streamed one)."""
        if info == self.info and last_turn == self._last_turn:
            return
        changed = info.content != self.info.content
        self.info = info
        self.query_one(".role", Static).update(self._role_line())
        if changed:
            await self.markdown.update(info.content)
        self._refresh_bars(last_turn=last_turn)

    def set_last_turn(self, last_turn: bool) -> None:
        if last_turn != self._last_turn:
            self._refresh_bars(last_turn=last_turn)

    # ------------------------------------------------------------------ streaming

    async def stream_to(self, text: str) -> None:
        """Extend the streamed body to ``text`` (the cumulative reply so far)."""
        if not text.startswith(self._shown_text):
            # Decoding revised earlier text (rare): restart the stream from scratch.
            await self._stop_stream()
            self._shown_text = ""
            await self.markdown.update("")
        delta = text[len(self._shown_text) :]
        if not delta:
            return
        if self._stream is None:
            await self.markdown.update("")
            self._stream = Markdown.get_stream(self.markdown)
        self._shown_text = text
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
        self.query_one(".role", Static).update(self._role_line())
        await self.markdown.update(info.content)
        self._refresh_bars(last_turn=True)


class Transcript(VerticalScroll):
    """The messages of the active path, with a welcome note while empty."""

    DEFAULT_CSS = """
    Transcript { height: 1fr; padding: 0 1; scrollbar-size-vertical: 1; }
    Transcript > #welcome { color: $text-muted; padding: 1 2; width: 1fr; }
    Transcript.-has-messages > #welcome { display: none; }
    """

    def __init__(self, *, welcome: str = "", id: str | None = None) -> None:
        super().__init__(id=id)
        self._welcome = welcome
        self._lock = asyncio.Lock()  # one sync / mount at a time

    def compose(self) -> ComposeResult:
        yield Static(self._welcome, id="welcome")

    def on_mount(self) -> None:
        self.anchor()

    def set_welcome(self, text: str) -> None:
        self.query_one("#welcome", Static).update(text)

    @property
    def views(self) -> list[MessageView]:
        return list(self.query_children(MessageView))

    async def sync(self, infos: list[MessageInfo]) -> None:
        """Show exactly ``infos``: keep views whose node ids match, remount the rest."""
        async with self._lock:
            await self._sync(infos)

    async def _sync(self, infos: list[MessageInfo]) -> None:
        views = self.views
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
        if new:
            await self.mount_all(new)
            for offset, view in enumerate(new):
                view.set_last_turn(keep + offset == last_assistant)
        self.set_class(bool(infos), "-has-messages")
        self.anchor()

    async def add_streaming_reply(self, info: MessageInfo) -> MessageView:
        """Mount the placeholder a new reply streams into."""
        view = MessageView(info, streaming=True)
        async with self._lock:
            await self.mount(view)
        self.set_class(True, "-has-messages")
        self.anchor()
        return view
