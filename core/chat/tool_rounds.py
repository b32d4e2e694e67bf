"""Tool rounds of a chat session (docs/DESIGN.md §12.1): the calls of a stored step, their
approval, their results stored as ``tool`` messages, and the next step generated.

The tree keeps a round as messages: the assistant step with its calls in
``meta["tool_calls"]`` (OpenAI form), then one ``tool`` node per call, each the child of
the one before (so the active path stays a chain), then the next assistant step under the
last result. A tool node's ``meta``: ``tool_call_id``, ``name`` (the function the model
called), ``server`` and ``tool`` (None when it named no tool), ``arguments`` (the text the
model wrote), ``is_error``, ``cancelled``, ``timed_out``, ``denied``.

The caller drives: after a step finishes, :meth:`ToolRounds.state` says what comes next
and which calls wait; each call is run (:meth:`ToolRounds.run`, after approval where
:meth:`ToolRounds.needs_approval`), denied (:meth:`ToolRounds.deny`) or answered as an
error, each result stored (:meth:`ToolRounds.add_result`); then
:meth:`ToolRounds.next_round` generates the next step from the path ending at the last
result, whose prompt extends the previous one by the results and a generation prompt, so
the cache restores everything before (docs/DESIGN.md §9). :meth:`ToolRounds.resolve` does
the whole sequence for a caller that can block (the line chat, tests).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..api import EventCallback
from ..tools.mcp_host import CallHandle, McpHost, ToolInfo, ToolResult
from .conversation_settings import ConversationSettings
from .session import ChatSession, SessionError, TurnHandle
from .store import Node
from .tool_rounds_logic import (
    DEFAULT_MAX_ROUNDS,
    PlannedCall,
    Step,
    denied_text,
    limit_text,
    next_step,
    plan_calls,
)

DEFAULT_CALL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RoundState:
    """Where a conversation stands after assistant step ``reply``: ``step`` "done" (no
    calls: the answer), "run" (``calls`` wait for results), "limit" (past the round limit:
    ``calls`` get "not run" results); ``rounds``: steps with calls since the last user
    message, this one included; ``last``: the node the next result goes under."""

    reply: Node
    step: Step
    calls: tuple[PlannedCall, ...]
    rounds: int
    last: Node


@dataclass(frozen=True)
class Decision:
    """A person's answer to a call: "once" (run it), "always" (run it, and this tool
    without asking for the rest of the conversation), "deny" (``reason`` goes to the
    model as the result)."""

    kind: Literal["once", "always", "deny"]
    reason: str = ""


class ToolRounds:
    """Tool rounds over ``session`` and ``host`` (None: no MCP servers; calls then get
    "not available" results). ``max_rounds``: steps with calls per answer;
    ``timeout_s``: one call's limit; ``auto_allow``: servers whose tools run without
    asking. Installs ``host`` as the session's tool catalog. Thread-safe as the session
    and the host are."""

    def __init__(
        self,
        session: ChatSession,
        host: McpHost | None,
        *,
        max_rounds: int = DEFAULT_MAX_ROUNDS,
        timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        auto_allow: Sequence[str] = (),
    ) -> None:
        self.session = session
        self.host = host
        self.max_rounds = max_rounds
        self.timeout_s = timeout_s
        self.auto_allow = frozenset(auto_allow)
        session.tools = host

    @classmethod
    def from_settings(cls, session: ChatSession, host: McpHost, settings: Any) -> ToolRounds:
        """Rounds with ``settings``' ``tool_rounds``, ``tool_timeout_s`` and
        ``tools_auto_allow`` (a ``config.settings.Settings``); a new conversation of
        ``session`` gets the tools of every server of ``host`` that is ready now."""
        rounds = cls(
            session,
            host,
            max_rounds=settings.tool_rounds,
            timeout_s=settings.tool_timeout_s,
            auto_allow=settings.tools_auto_allow,
        )
        ready = tuple(s.name for s in host.status() if s.state == "ready")
        session.defaults = dataclasses.replace(session.defaults, tools=ready)
        return rounds

    # ------------------------------------------------------------------ tools

    def tools(self, conversation_id: int | None = None) -> list[ToolInfo]:
        """The tools the model gets in ``conversation_id`` (default: the open one)."""
        settings = self.session.settings(conversation_id)
        if self.host is None or not settings.tools:
            return []
        return self.host.tools(settings.tools)

    def set_servers(
        self, servers: Sequence[str], conversation_id: int | None = None
    ) -> ConversationSettings:
        """Enable exactly ``servers`` in the conversation (saved with it; a new
        conversation is opened when none is). Raises ``KeyError`` for a server not in the
        config."""
        known = [c.name for c in self.host.configs] if self.host is not None else []
        unknown = [s for s in servers if s not in known]
        if unknown:
            raise KeyError(
                f"no MCP server {unknown[0]!r} (configured: {', '.join(known) or 'none'})"
            )
        session = self.session
        if conversation_id is None and session.conversation_id is None:
            session.new_conversation()
        cid = session.conversation_id if conversation_id is None else conversation_id
        ordered = tuple(name for name in known if name in servers)
        settings = dataclasses.replace(session.settings(cid), tools=ordered)
        session.store.set_conversation_settings(cid, settings.to_dict())
        return settings

    # ------------------------------------------------------------------ a step's calls

    def state(self, reply: Node | None = None) -> RoundState | None:
        """The round state after ``reply`` (default: the last assistant step of the open
        conversation's active path); None when there is no such step."""
        store = self.session.store
        if reply is None:
            path = self.session.active_path()
            steps = [n for n in path if n.role == "assistant"]
            if not steps:
                return None
            reply = steps[-1]
        reply = store.get_node(reply.id)
        path = store.path_to(reply.id)
        rounds = 0
        for node in reversed(path):
            if node.role == "user":
                break
            if node.role == "assistant" and (node.meta or {}).get("tool_calls"):
                rounds += 1
        last, answered = reply, set()
        while True:
            child = store.selected_child(last.id)
            if child is None or child.role != "tool":
                break
            answered.add((child.meta or {}).get("tool_call_id"))
            last = child
        meta = reply.meta or {}
        tools = self.tools(reply.conversation_id)
        planned = plan_calls(meta.get("tool_calls") or (), tools, meta.get("tool_call_errors"))
        waiting = tuple(c for c in planned if c.id not in answered)
        step = next_step(len(planned), rounds, self.max_rounds)
        return RoundState(reply, step, waiting, rounds, last)

    def needs_approval(self, call: PlannedCall, conversation_id: int) -> bool:
        """Whether a person must approve ``call``: not for a call that cannot run (its
        error is the result), a server in ``auto_allow``, or a tool allowed for the
        conversation."""
        if call.tool is None or call.tool.server in self.auto_allow:
            return False
        return call.tool.display not in self.session.settings(conversation_id).allowed_tools

    def allow_tool(self, call: PlannedCall, conversation_id: int) -> None:
        """Run ``call``'s tool without asking for the rest of the conversation (saved)."""
        if call.tool is None:
            return
        settings = self.session.settings(conversation_id)
        if call.tool.display not in settings.allowed_tools:
            allowed = (*settings.allowed_tools, call.tool.display)
            settings = dataclasses.replace(settings, allowed_tools=allowed)
            self.session.store.set_conversation_settings(conversation_id, settings.to_dict())

    def run(self, call: PlannedCall) -> CallHandle:
        """Start ``call`` on its server (returns at once). Raises :class:`SessionError` for
        a call that cannot run (answer it with :meth:`add_result` of
        :meth:`error_result`)."""
        if call.tool is None or self.host is None:
            raise SessionError(f"{call.function} cannot run: {call.error or 'no MCP host'}")
        return self.host.call(call.tool, call.arguments, self.timeout_s)

    @staticmethod
    def error_result(call: PlannedCall) -> ToolResult:
        """The result of a call that cannot run: its error, said to the model."""
        return ToolResult(f"error: {call.error}", True)

    def add_result(
        self, state: RoundState, call: PlannedCall, result: ToolResult, *, denied: bool = False
    ) -> Node:
        """Store ``result`` of ``call`` under ``state.last`` (selected); returns the tool
        node (the next result, or the next step, goes under it)."""
        meta: dict[str, Any] = {
            "tool_call_id": call.id,
            "name": call.function,
            "server": call.tool.server if call.tool else None,
            "tool": call.tool.tool if call.tool else None,
            "arguments": call.arguments_text,
            "is_error": result.is_error,
            "cancelled": result.cancelled,
            "timed_out": result.timed_out,
            "denied": denied,
        }
        parent = self.session.store.get_node(self._last(state).id)
        return self.session.store.add_node(
            parent.conversation_id, parent.id, "tool", result.text, meta=meta
        )

    def deny(self, state: RoundState, call: PlannedCall, reason: str = "") -> Node:
        """Store a denied call's result: ``reason`` said to the model."""
        return self.add_result(state, call, ToolResult(denied_text(reason), True), denied=True)

    def limit_result(self) -> ToolResult:
        return ToolResult(limit_text(self.max_rounds), True)

    def _last(self, state: RoundState) -> Node:
        """The newest node of ``state``'s chain of results (results stored since)."""
        fresh = self.state(state.reply)
        return fresh.last if fresh is not None else state.last

    # ------------------------------------------------------------------ the next step

    def next_round(
        self,
        state: RoundState,
        *,
        max_tokens: int | None = None,
        on_event: EventCallback | None = None,
    ) -> TurnHandle:
        """Generate the step after ``state``'s results (every call answered). Raises
        :class:`SessionError` when a call has no result yet or nothing was called."""
        fresh = self.state(state.reply)
        if fresh is None or fresh.step == "done" or fresh.calls:
            raise SessionError("the step's calls are not all answered yet")
        return self.session.generate_after(fresh.last.id, max_tokens=max_tokens, on_event=on_event)

    def regenerate_step(
        self, reply_id: int, *, max_tokens: int | None = None, on_event: EventCallback | None = None
    ) -> TurnHandle:
        """A new sibling of assistant step ``reply_id`` (after a user message or a tool
        result), selected when done: its prompt is the path to the step's parent, so the
        cache restores all of it and prefills only the generation prompt."""
        reply = self.session.store.get_node(reply_id)
        if reply.role != "assistant" or reply.parent_id is None:
            raise SessionError("only a reply can be regenerated")
        return self.session.generate_after(
            reply.parent_id, regenerate=True, max_tokens=max_tokens, on_event=on_event
        )

    # ------------------------------------------------------------------ blocking driver

    def resolve(
        self,
        state: RoundState,
        decide: Callable[[PlannedCall], Decision],
        *,
        wait: Callable[[CallHandle], ToolResult] | None = None,
        on_result: Callable[[PlannedCall, Node], None] | None = None,
    ) -> bool:
        """Answer every waiting call of ``state`` in order: errors and "limit" at once,
        the rest after ``decide`` (asked only where :meth:`needs_approval`), run and waited
        for with ``wait`` (default: ``handle.result()``; a caller's Ctrl-C handler cancels
        there). ``on_result(call, tool_node)`` after each. Returns whether the next round
        should run (False: no calls, or the limit)."""
        wait = wait or (lambda handle: handle.result())
        cid = state.reply.conversation_id
        for call in state.calls:
            if state.step == "limit":
                node = self.add_result(state, call, self.limit_result())
            elif call.tool is None:
                node = self.add_result(state, call, self.error_result(call))
            else:
                decision = decide(call) if self.needs_approval(call, cid) else Decision("once")
                if decision.kind == "deny":
                    node = self.deny(state, call, decision.reason)
                else:
                    if decision.kind == "always":
                        self.allow_tool(call, cid)
                    node = self.add_result(state, call, wait(self.run(call)))
            if on_result is not None:
                on_result(call, node)
        return state.step == "run"


def call_summary(call: PlannedCall, width: int = 200) -> str:
    """``server.tool {"arg": ...}`` in one line of at most ``width`` characters."""
    try:
        args = (
            json.dumps(call.arguments, ensure_ascii=False)
            if not call.error
            else call.arguments_text
        )
    except (TypeError, ValueError):
        args = call.arguments_text
    text = f"{call.display} {args}".replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"
