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
    """The file of a shipped session (``claude-code``, ``codex``, ``opencode``: ``agent-
    <name>.jsonl`` or ``.jsonl.gz`` in :data:`SESSIONS_DIR`) or the path given."""
    if str(name_or_path) in SESSION_NAMES:
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
