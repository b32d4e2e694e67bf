"""Recorded agent-CLI sessions: the requests Claude Code, Codex CLI and OpenCode sent, one
JSON object a line, as ``scripts/record_agent_session.py`` saved them (the shipped ones and
how they were made: ``cli/workloads/README.md``).

A line is ``{"api": "messages" | "responses" | "chat", "path": ..., "body": {...}}`` and
optionally ``"headers"`` (the few that name the client). The bodies are the clients' JSON,
unmodified but for the scratch paths and Claude Code's device id.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Api = Literal["messages", "responses", "chat"]
APIS: tuple[Api, ...] = ("messages", "responses", "chat")
SESSIONS_DIR = Path(__file__).resolve().parents[1] / "workloads"
SESSION_NAMES: tuple[str, ...] = ("claude-code", "codex", "opencode")
# sessions that grow past 64K tokens (``agent-<name>.jsonl.gz``), kept apart from the short
# ones that tests replay on tiny models
LONG_SESSION_NAMES: tuple[str, ...] = ("claude-code-long",)


@dataclass(frozen=True)
class RecordedRequest:
    """One request of a session: its wire (``api``), URL path (with query, as sent) and
    JSON body."""

    api: Api
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def has_tools(self) -> bool:
        """A main turn of the agent (it offers tools), not a side request (a title)."""
        return bool(self.body.get("tools"))


def session_path(name_or_path: str | Path) -> Path:
    """The file of a shipped session (``claude-code``, ``codex``, ``opencode``,
    ``claude-code-long``: ``agent-<name>.jsonl`` or ``.jsonl.gz`` in :data:`SESSIONS_DIR`)
    or the path given."""
    if str(name_or_path) in SESSION_NAMES + LONG_SESSION_NAMES:
        for suffix in (".jsonl", ".jsonl.gz"):
            path = SESSIONS_DIR / f"agent-{name_or_path}{suffix}"
            if path.exists():
                return path
        raise FileNotFoundError(f"no recorded session {name_or_path!r} in {SESSIONS_DIR}")
    return Path(name_or_path)


def load_session(name_or_path: str | Path) -> list[RecordedRequest]:
    """The requests of a session, in the order they were sent; a ``.gz`` file is gunzipped.

    Raises:
        FileNotFoundError: no such session or file.
        ValueError: a line that is not JSON, or lacks a known ``api``, a ``path`` or an
            object ``body`` (the message names the file and line).
    """
    path = session_path(name_or_path)
    data = path.read_bytes()
    text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")
    requests: list[RecordedRequest] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: not a JSON object")
        api, url, body = row.get("api"), row.get("path"), row.get("body")
        if api not in APIS or not isinstance(url, str) or not isinstance(body, dict):
            raise ValueError(f"{path}:{n}: needs api in {APIS}, a path and an object body")
        requests.append(RecordedRequest(api, url, body, dict(row.get("headers") or {})))
    return requests


def replay_body(request: RecordedRequest, max_tokens: int) -> dict[str, Any]:
    """``request``'s body as a replay sends it: whole (not streamed), greedy, at most
    ``max_tokens`` generated, nothing stored; everything else as the client sent it."""
    body = dict(request.body)
    body.pop("stream_options", None)
    body["stream"] = False
    body["temperature"] = 0
    if request.api == "chat":
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = max_tokens
    elif request.api == "responses":
        body["max_output_tokens"] = max_tokens
        body["store"] = False
    else:
        body["max_tokens"] = max_tokens
        body.pop("top_p", None)  # Anthropic's API takes temperature or top_p, not both
    return body


def as_chat_body(request: RecordedRequest, state: Any, max_tokens: int) -> dict[str, Any]:
    """The same conversation as a ``/v1/chat/completions`` body: ``request`` read by its
    own API's adapter into the one internal request, written back as OpenAI chat JSON
    (messages, tools, tool choice). Raises the adapter's ``APIError`` for a body it
    refuses."""
    from tierchat.core.serve import anthropic_api, openai_api, responses_input

    body = replay_body(request, max_tokens)
    if request.api == "chat":
        chat = openai_api.chat_request(body, state)
    elif request.api == "responses":
        chat = responses_input.chat_request(body, responses_input.input_items(body), state)
    else:
        chat = anthropic_api.chat_request(body, state)
    messages = [{k: v for k, v in m.items() if k != "token_ids"} for m in chat.messages]
    out: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": False,
    }
    if chat.tools:
        out["tools"] = list(chat.tools)
        out["tool_choice"] = (
            {"type": "function", "function": {"name": chat.forced_tool}}
            if chat.forced_tool
            else chat.tool_choice
        )
    if chat.enable_thinking is not None:
        out["chat_template_kwargs"] = {"enable_thinking": chat.enable_thinking}
    return out


def _append_text(content: Any, tag: str, part_type: str) -> Any:
    """``content`` (a string or a list of parts) with ``tag`` after its last text part."""
    if isinstance(content, str):
        return content + tag
    parts = list(content or [])
    for i in range(len(parts) - 1, -1, -1):
        part = parts[i]
        if isinstance(part, dict) and part.get("type") in ("text", "input_text"):
            parts[i] = {**part, "text": str(part.get("text", "")) + tag}
            return parts
    return [*parts, {"type": part_type, "text": tag.strip()}]


def with_suffix(request: RecordedRequest, tag: str) -> RecordedRequest:
    """``request`` with ``tag`` appended to the text of its conversation's first user
    message: copies of one session tagged apart are different conversations that share
    the system prompt, the tools and the user message's text up to the tag (sub-agents of
    one agent). ``tag`` "": the request itself. Raises ValueError for a conversation
    without a user message."""
    if not tag:
        return request
    key = "input" if request.api == "responses" else "messages"
    items = request.body.get(key)
    if isinstance(items, str):  # a Responses input given as one string
        return RecordedRequest(
            request.api, request.path, {**request.body, key: items + tag}, request.headers
        )
    items = list(items or [])
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("role") == "user":
            kind = "input_text" if request.api == "responses" else "text"
            items[i] = {**item, "content": _append_text(item.get("content"), tag, kind)}
            body = {**request.body, key: items}
            return RecordedRequest(request.api, request.path, body, request.headers)
    raise ValueError(f"a {request.api} request without a user message: nothing to tag")
