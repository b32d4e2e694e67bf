"""Tool rounds in the chat (docs/DESIGN.md §12.1, §16): after a reply with tool calls,
each call is approved (``ToolApprovalScreen``, unless its tool is allowed), run on its
MCP server and its result stored, then the next step is generated, by itself, until a
step makes no call or the round limit answers the calls "not run".

:class:`ToolRoundRunner` is owned by the message pane (``pane.py``, ``MessagePane``) and
reaches it only through :class:`RoundHost`. The pane hands it every finished turn
(:meth:`ToolRoundRunner.after_turn`); a round runs as a worker on the UI loop that awaits
the store writes (the background writer's thread) and the call (the host's thread signals
the loop when it is done; no widget is touched there). Esc (:meth:`ToolRoundRunner.stop`)
cancels a running call: it and the calls after it are stored as cancelled and no next
step starts. The Events log names each round (``round 2 · files.read_file {…}``).

``/tools`` in the input lists the servers, their state, whether the conversation has
them, and their tools; ``/tools on NAME`` and ``/tools off NAME`` enable or disable a
server in the conversation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tierchat.core.chat.tool_rounds import call_summary
from tierchat.core.tools.mcp_host import ToolResult
from tierchat.tui.screens.tool_approval import Approval, ToolApprovalScreen
from tierchat.tui.turns import SessionCall
from tierchat.tui.widgets.transcript import MessageInfo, MessageView, Transcript

if TYPE_CHECKING:
    from tierchat.tui.app import TierchatApp

CANCELLED = "the call was cancelled by the user"
"""The result a call stopped by Esc (or never started after it) gives the model."""


class RoundHost(Protocol):
    """What :class:`ToolRoundRunner` needs of the message pane."""

    @property
    def tierchat(self) -> TierchatApp: ...

    @property
    def conversation_id(self) -> int | None:
        """The conversation shown."""

    def path_infos(self, conversation_id: int | None = None) -> list[MessageInfo]: ...

    def in_background(self, title: str, call: Callable[[], Any]) -> Awaitable[tuple[bool, Any]]:
        """Run ``call`` off the UI loop, in order with the other store writes."""

    def start_round(self, conversation_id: int, call: SessionCall) -> Awaitable[bool]:
        """Stream the turn ``call(on_event)`` starts in ``conversation_id``."""

    async def resync(self, selected: int | None) -> None:
        """Show the active path as stored now."""

    def rounds_changed(self, *, ended: bool) -> None:
        """A round started or ended: the keys and the stop binding follow."""

    def ensure_conversation(self) -> Awaitable[bool]:
        """Create the conversation shown if it is new (False after an error)."""

    def widgets(self) -> tuple[Transcript, Any, Any]:
        """The transcript, the activity bar and the input."""

    def run_worker(self, work: Any, **kwargs: Any) -> Any: ...

    def notify(self, message: str, **kwargs: Any) -> None: ...


@dataclass
class LiveRound:
    """The round in flight in one conversation: the call running (its handle) and
    whether Esc stopped it."""

    conversation_id: int
    handle: Any = None
    stopped: bool = False
    views: list[MessageView] = field(default_factory=list)


class ToolRoundRunner:
    """The tool rounds of one message pane, one per conversation at a time."""

    def __init__(self, host: RoundHost) -> None:
        self.host = host
        self.live: dict[int, LiveRound] = {}

    @property
    def rounds(self) -> Any:
        """The session's ``ToolRounds`` (None without MCP servers)."""
        return self.host.tierchat.tools.rounds

    def active(self, conversation_id: int | None) -> bool:
        """A round of ``conversation_id`` is being answered (approval or a call)."""
        return conversation_id is not None and conversation_id in self.live

    def stop(self, conversation_id: int | None) -> None:
        """Esc: cancel the running call of ``conversation_id``'s round (returns at once);
        the calls left are answered "cancelled" and no next step starts."""
        live = self.live.get(conversation_id) if conversation_id is not None else None
        if live is None:
            return
        live.stopped = True
        if live.handle is not None:
            live.handle.cancel()

    def after_turn(self, conversation_id: int, handle: Any, finish_reason: str) -> None:
        """A turn finished (its reply stored): run its calls, if it made any (not for a
        reply stopped by Esc)."""
        reply = getattr(handle, "reply_node", None)
        if self.rounds is None or reply is None or finish_reason == "cancelled":
            return
        if not (reply.meta or {}).get("tool_calls") or conversation_id in self.live:
            return
        self.live[conversation_id] = LiveRound(conversation_id)
        self.host.rounds_changed(ended=False)
        self.host.run_worker(self._run(conversation_id, reply), group=f"round-{conversation_id}")

    def regenerate_call(self, reply_id: int) -> SessionCall:
        """A regenerate of the step ``reply_id`` that follows a tool result: its prompt
        is the path to the result (all restored from the cache)."""
        rounds = self.rounds
        return lambda on_event: rounds.regenerate_step(reply_id, on_event=on_event)

    # ------------------------------------------------------------------ one round

    async def _run(self, cid: int, reply: Any) -> None:
        live = self.live[cid]
        try:
            next_step = await self._answer(cid, reply, live)
        except asyncio.CancelledError:  # the pane goes away (quit): no widget to update
            del self.live[cid]
            if live.handle is not None:
                live.handle.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the UI boundary: report, never crash
            next_step = None
            self.host.notify(
                str(e) or type(e).__name__, title="Tool round failed", severity="error"
            )
        del self.live[cid]
        if next_step is not None and not live.stopped:
            # the turn is registered before start_round's first await: the conversation
            # stays busy (no send slips in between the round and its next step)
            await self.host.start_round(cid, next_step)
        else:
            self.host.rounds_changed(ended=True)

    async def _answer(self, cid: int, reply: Any, live: LiveRound) -> SessionCall | None:
        """Answer every call of ``reply``; the next step's session call, or None."""
        rounds, app = self.rounds, self.host.tierchat
        ok, state = await self.host.in_background("Tool round failed", lambda: rounds.state(reply))
        if not ok or state is None or not state.calls:
            return None
        what = ", ".join(call_summary(c, 80) for c in state.calls)
        app.note_event(f"round {state.rounds} · {what}")
        for call in state.calls:
            result, denied = await self._outcome(cid, state, call, live)
            if denied is not None:
                store = lambda c=call, r=denied: rounds.deny(state, c, r)  # noqa: E731
            else:
                store = lambda c=call, r=result: rounds.add_result(state, c, r)  # noqa: E731
            ok, _ = await self.host.in_background("Cannot store the tool result", store)
            await self._show(cid)
            if not ok:
                return None
        if state.step != "run" or live.stopped:
            if state.step == "limit":
                self.host.notify(
                    f"The limit of {rounds.max_rounds} tool rounds is reached: the calls "
                    "were not run.",
                    title="Tool rounds",
                    severity="warning",
                )
            return None
        app.note_event(f"round {state.rounds} · next step after {len(state.calls)} result(s)")
        return lambda on_event: rounds.next_round(state, on_event=on_event)

    async def _outcome(
        self, cid: int, state: Any, call: Any, live: LiveRound
    ) -> tuple[ToolResult, str | None]:
        """One call's result, or ``(_, reason)`` for a call the user denied."""
        rounds = self.rounds
        if live.stopped:
            return ToolResult(CANCELLED, True, cancelled=True), None
        if state.step == "limit":
            return rounds.limit_result(), None
        if call.tool is None:
            return rounds.error_result(call), None
        ok, ask = await self.host.in_background(
            "Tool round failed", lambda: rounds.needs_approval(call, cid)
        )
        if ok and ask:
            approval = await self._approve(call, state.rounds)
            if approval.decision == "deny":
                return ToolResult("", True), approval.reason
            if approval.decision == "always":
                allow = lambda: rounds.allow_tool(call, cid)  # noqa: E731
                await self.host.in_background("Cannot save the allowed tool", allow)
        elif not ok:
            return ToolResult("error: the approval could not be read", True), None
        if live.stopped:
            return ToolResult(CANCELLED, True, cancelled=True), None
        return await self._call(cid, call, live)

    async def _approve(self, call: Any, round_no: int) -> Approval:
        done: asyncio.Future[Approval] = asyncio.get_running_loop().create_future()
        screen = ToolApprovalScreen(
            call.tool.server, call.tool.tool, call.arguments_text, round_no=round_no
        )
        self.host.tierchat.push_screen(screen, done.set_result)
        return await done

    async def _call(self, cid: int, call: Any, live: LiveRound) -> tuple[ToolResult, None]:
        """Run ``call``; a "running" block shows meanwhile (Esc cancels the call)."""
        loop = asyncio.get_running_loop()
        finished = asyncio.Event()
        try:
            handle = self.rounds.run(call)
        except Exception as e:  # noqa: BLE001 - the result says it; the chat goes on
            return ToolResult(f"error: {e}", True), None
        live.handle = handle
        # the host's thread: only a thread-safe wake-up of the loop
        handle.add_done_callback(lambda _h: loop.call_soon_threadsafe(finished.set))
        await self._show_running(cid, call, live)
        await finished.wait()
        live.handle = None
        return handle.result(), None

    # ------------------------------------------------------------------ the transcript

    async def _show_running(self, cid: int, call: Any, live: LiveRound) -> None:
        if self.host.conversation_id != cid:
            return
        transcript = self.host.widgets()[0]
        infos = self.host.path_infos()
        turn = sum(1 for i in infos if i.role == "user") - 1
        info = MessageInfo(
            None, "tool", call_summary(call), turn, tool=call.display, tool_state="running"
        )
        live.views.append(await transcript.add_streaming_reply(info))

    async def _show(self, cid: int) -> None:
        if self.host.conversation_id == cid:
            await self.host.resync(None)

    # ------------------------------------------------------------------ /tools

    async def command(self, rest: str) -> None:
        """``/tools`` (the servers and tools), ``/tools on|off NAME``, said in a
        notification."""
        host = self.host
        verb, _, name = rest.partition(" ")
        if rest and (verb not in ("on", "off") or not name.strip() or self.rounds is None):
            usage = "/tools, /tools on NAME, /tools off NAME"
            host.notify(f"usage: {usage}", title="Tools", severity="warning")
            return
        if not rest:
            ok, text = host.tierchat.attempt(
                "Cannot list the tools", lambda: self.tools_text(host.conversation_id)
            )
            if ok:
                host.notify(text, title="Tools (MCP servers)", timeout=15)
            return
        if not await host.ensure_conversation():
            return
        cid = host.conversation_id
        call = lambda: self.set_server(cid, verb, name.strip())  # noqa: E731
        ok, said = await host.in_background("Cannot change the tools", call)
        if ok:
            host.notify(said, title="Tools", timeout=4)

    def tools_text(self, conversation_id: int | None) -> str:
        """``/tools``: each server (on/off here, transport, state, error) and its tools."""
        app = self.host.tierchat
        if not app.tools.enabled:
            return "No MCP servers: add them to mcp.json in the config dir, or --mcp-config."
        enabled = set(app.session.settings(conversation_id).tools)
        lines = []
        for status in app.tools.host.status():
            on = "on " if status.name in enabled else "off"
            lines.append(f"{on} {status.name} ({status.transport}, {status.state})")
            if status.error:
                lines += [f"    {line}" for line in status.error.splitlines()[-4:]]
            for tool in status.tools:
                desc = " ".join(tool.description.split())[:60]
                lines.append(f"    {tool.display}: {desc}")
        return "\n".join(lines)

    def set_server(self, conversation_id: int, verb: str, name: str) -> str:
        """``/tools on|off NAME`` in ``conversation_id`` (off the UI loop: a store write);
        returns the line to show. Raises ``KeyError`` for a server not configured."""
        app = self.host.tierchat
        enabled = list(app.session.settings(conversation_id).tools)
        enabled = [*enabled, name] if verb == "on" else [s for s in enabled if s != name]
        self.rounds.set_servers(enabled, conversation_id)
        return f"{name} is {verb} in this conversation."
