"""The MCP servers a chat may use: ``mcp.json`` read into typed server configs
(docs/DESIGN.md §12.1).

The file is the notation Claude Desktop, Cursor and LM Studio share::

    {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "."],
                  "env": {"KEY": "value"}, "cwd": "/somewhere"},
        "search": {"url": "http://127.0.0.1:8931/mcp", "headers": {"Authorization": "Bearer x"}}
    }}

A server with ``command`` is a stdio server (a subprocess speaking JSON-RPC on its stdin
and stdout); one with ``url`` a streamable-HTTP server. ``"disabled": true`` keeps an entry
in the file without starting it (LM Studio's and Cline's key). Other keys of an entry
(``type``, ``description``, ...) are ignored, as those apps do; ``type`` ``"sse"`` (the
deprecated HTTP+SSE transport) is refused by name.

The file is ``mcp.json`` in the config dir (next to ``config.toml``), or the path given by
the ``mcp_config`` setting (``--mcp-config PATH``). A missing default file means no
servers; a missing named file, invalid JSON or a malformed entry is a
:class:`McpConfigError` naming the file and the key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

MCP_FILENAME = "mcp.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class McpConfigError(ValueError):
    """A malformed ``mcp.json``: the message names the file and the key."""


@dataclass(frozen=True)
class ServerConfig:
    """One MCP server. ``transport`` "stdio": ``command`` + ``args`` run with ``env`` over
    the SDK's safe subset of our environment (``HOME``, ``PATH``, ``USER``...: mcp's
    ``get_default_environment``), in ``cwd`` (None: ours); "http": streamable HTTP at ``url``
    with ``headers`` on every request."""

    name: str
    transport: Literal["stdio", "http"]
    command: str = ""
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise McpConfigError(f"{where} must be a list of strings")
    return tuple(value)


def _string_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise McpConfigError(f"{where} must be an object of strings")
    return dict(value)


def parse_servers(data: Any, source: str) -> list[ServerConfig]:
    """The enabled servers of ``data`` (the decoded JSON of ``source``), in file order.

    Raises:
        McpConfigError: ``data`` has no ``mcpServers`` object, or an entry is malformed
            (the message says ``source: mcpServers.NAME.KEY ...``).
    """
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers"), dict):
        raise McpConfigError(f'{source}: expected {{"mcpServers": {{...}}}} at the top')
    out = []
    for name, entry in data["mcpServers"].items():
        where = f"{source}: mcpServers.{name}"
        if not _NAME_RE.match(name):
            raise McpConfigError(f"{where}: a server name is 1-64 letters, digits, '_', '-' or '.'")
        if not isinstance(entry, dict):
            raise McpConfigError(f"{where} must be an object")
        if entry.get("disabled") is True:
            continue
        if entry.get("type") == "sse":
            raise McpConfigError(
                f"{where}.type: the HTTP+SSE transport is not supported; use streamable HTTP"
            )
        has_cmd, has_url = "command" in entry, "url" in entry
        if has_cmd == has_url:
            raise McpConfigError(f"{where}: give either command (stdio) or url (HTTP), one")
        if has_cmd:
            command = entry["command"]
            if not isinstance(command, str) or not command.strip():
                raise McpConfigError(f"{where}.command must be a non-empty string")
            cwd = entry.get("cwd")
            if cwd is not None and not isinstance(cwd, str):
                raise McpConfigError(f"{where}.cwd must be a string")
            out.append(
                ServerConfig(
                    name,
                    "stdio",
                    command=command,
                    args=_strings(entry.get("args", []), f"{where}.args"),
                    env=_string_map(entry.get("env", {}), f"{where}.env"),
                    cwd=cwd,
                )
            )
        else:
            url = entry["url"]
            if not isinstance(url, str) or not re.match(r"^https?://", url):
                raise McpConfigError(f"{where}.url must be an http:// or https:// URL")
            headers = _string_map(entry.get("headers", {}), f"{where}.headers")
            out.append(ServerConfig(name, "http", url=url, headers=headers))
    return out


def default_mcp_path(config_dir: Path) -> Path:
    """``mcp.json`` in ``config_dir`` (the directory of the default ``config.toml``)."""
    return config_dir / MCP_FILENAME


def load_servers(path: Path, *, explicit: bool) -> list[ServerConfig]:
    """The servers of the file at ``path``. ``explicit`` (a path the user named): a missing
    file is an error; otherwise it means no servers.

    Raises:
        McpConfigError: the file is missing (``explicit``), unreadable, not UTF-8 JSON, or
            malformed (:func:`parse_servers`).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if explicit:
            raise McpConfigError(f"MCP config {path} does not exist") from None
        return []
    except UnicodeDecodeError as e:
        raise McpConfigError(f"MCP config {path} is not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise McpConfigError(f"MCP config {path} cannot be read: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise McpConfigError(
            f"MCP config {path} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        ) from None
    return parse_servers(data, str(path))
