"""The MCP host: client sessions to the configured servers on one asyncio loop of their own
(docs/DESIGN.md §12.1).

The TUI (Textual's loop) and the line chat (a plain thread) both call it from their own
threads: every public method is thread-safe and returns at once or waits on a
``concurrent.futures.Future``; all MCP work runs on the host's loop thread, one task per
server that holds the server's ``mcp.Client`` from start to close (the SDK's anyio task
groups are entered and left in that one task).

- **Start** (:meth:`McpHost.start`): stdio servers are spawned by the SDK's
  ``stdio_client`` in a session of their own, their stderr captured to a private temporary
  file; HTTP servers are reached by ``streamable_http_client`` with the entry's headers.
  A server that fails to spawn, exits, refuses the connection or does not finish the
  handshake and its tool listing within ``start_timeout_s`` is "failed", its error with
  the tail of its stderr; never a hang.
- **Tools** (:meth:`McpHost.tools`): each server's ``tools/list``, in its order, servers
  in config order. The model gets a function name valid for every API
  (``^[A-Za-z0-9_-]{1,64}$``): the tool's own name where no other enabled server has a
  tool of that name, else ``<server>__<tool>`` (characters outside the set become
  ``_``). A person sees ``server.tool`` (:attr:`ToolInfo.display`).
- **Calls** (:meth:`McpHost.call`): a :class:`CallHandle`; its result is a
  :class:`ToolResult` (the text parts of the MCP result joined, ``is_error`` as the server
  said). A call past ``timeout_s`` is cancelled and is an error result; a server that
  dies mid-call is an error result naming its exit and stderr tail (and the server is
  failed from then on); :meth:`CallHandle.cancel` returns at once and the result is
  marked ``cancelled`` (the SDK tells the server with ``notifications/cancelled``).
- **Close** (:meth:`McpHost.close`): every session is left (stdio: stdin closed, then the
  SDK's terminate/kill of the server's process group), the loop stopped and closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any, Literal

from .config import ServerConfig

START_TIMEOUT_S = 30.0
STDERR_TAIL_LINES = 12
_FUNCTION_RE = re.compile(r"[^A-Za-z0-9_-]")

ServerState = Literal["starting", "ready", "failed", "stopped"]


@dataclass(frozen=True)
class ToolInfo:
    """One tool of one server. ``function``: the name the model calls it by (module
    docstring); ``input_schema``: its JSON Schema for the arguments."""

    server: str
    tool: str
    function: str
    description: str
    input_schema: dict[str, Any] = field(hash=False, compare=False)

    @property
    def display(self) -> str:
        """``server.tool``, the name shown to a person."""
        return f"{self.server}.{self.tool}"

    def spec(self) -> dict[str, Any]:
        """The OpenAI function tool the chat template renders."""
        return {
            "type": "function",
            "function": {
                "name": self.function,
                "description": self.description,
                "parameters": self.input_schema or {"type": "object", "properties": {}},
            },
        }


@dataclass(frozen=True)
class ToolResult:
    """A call's outcome: ``text`` for the model (the tool's text, or what went wrong);
    ``is_error``: the server said so, or the call failed (timeout, dead server, cancel);
    ``cancelled``: stopped by the user; ``timed_out``: past its timeout."""

    text: str
    is_error: bool = False
    cancelled: bool = False
    timed_out: bool = False


@dataclass(frozen=True)
class ServerStatus:
    """A server as the host sees it now. ``error``: why it failed (with its stderr tail)."""

    name: str
    transport: Literal["stdio", "http"]
    state: ServerState
    error: str = ""
    tools: tuple[ToolInfo, ...] = ()


class CallHandle:
    """One tool call in flight. Thread-safe."""

    def __init__(self, future: concurrent.futures.Future, tool: ToolInfo) -> None:
        self._future = future
        self.tool = tool

    @property
    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        """Stop the call; returns at once. :meth:`result` is then a cancelled result."""
        self._future.cancel()

    def result(self, timeout: float | None = None) -> ToolResult:
        """Wait for the outcome. Raises ``TimeoutError`` only when ``timeout`` (seconds
        of this wait, not the call's own timeout) passes first."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.CancelledError:
            return ToolResult("the call was cancelled by the user", True, cancelled=True)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self.tool.display} still running") from None

    def add_done_callback(self, fn: Callable[[CallHandle], None]) -> None:
        """``fn(self)`` once done (on the host's thread, or at once when already done)."""
        self._future.add_done_callback(lambda _f: fn(self))


def function_names(tools: list[tuple[str, str]]) -> list[str]:
    """The model's function name for each ``(server, tool)``: the tool's own name when no
    other entry has it, else ``server__tool``; characters outside ``[A-Za-z0-9_-]`` become
    ``_``, cut at 64."""
    counts: dict[str, int] = {}
    for _, tool in tools:
        counts[tool] = counts.get(tool, 0) + 1
    out = []
    for server, tool in tools:
        name = tool if counts[tool] == 1 else f"{server}__{tool}"
        out.append(_FUNCTION_RE.sub("_", name)[:64] or "tool")
    return out


def error_text(e: BaseException) -> str:
    """One line for an exception (the first leaf of an exception group)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = str(e).strip() or type(e).__name__
    return text if type(e).__name__ in text else f"{type(e).__name__}: {text}"


class _Server:
    """The host's state for one server (touched on the loop thread only, but ``status``)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state: ServerState = "starting"
        self.error = ""
        self.tools: list[Any] = []  # mcp Tool objects
        self.client: Any = None
        self.stderr: IO[str] | None = None
        self.process_exit: Callable[[], int | None] = lambda: None
        self.ready = threading.Event()  # started or failed
        self.task: asyncio.Task | None = None

    def stderr_tail(self, max_lines: int = STDERR_TAIL_LINES) -> str:
        if self.stderr is None:
            return ""
        try:
            fd = self.stderr.fileno()
            size = os.fstat(fd).st_size
            data = os.pread(fd, 4096, max(0, size - 4096))
        except (OSError, ValueError):
            return ""
        lines = data.decode("utf-8", "replace").splitlines()
        return "\n".join(line.rstrip() for line in lines[-max_lines:] if line.strip())

    def fail(self, why: str) -> None:
        tail = self.stderr_tail()
        self.state = "failed"
        self.error = why + (f"\nits stderr ends:\n{tail}" if tail else "")
        self.ready.set()

    def status(self, tools: tuple[ToolInfo, ...]) -> ServerStatus:
        return ServerStatus(self.config.name, self.config.transport, self.state, self.error, tools)


class McpHost:
    """Client sessions to ``servers`` (module docstring). Nothing starts before
    :meth:`start`; use as a context manager or call :meth:`close`."""

    def __init__(
        self, servers: Iterable[ServerConfig], *, start_timeout_s: float = START_TIMEOUT_S
    ):
        self.configs = list(servers)
        self.start_timeout_s = start_timeout_s
        self._servers: dict[str, _Server] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                self._stop = asyncio.Event()
                loop.call_soon(started.set)
                loop.run_forever()

            self._thread = threading.Thread(target=run, name="tierchat-mcp", daemon=True)
            self._thread.start()
            started.wait()
            self._loop = loop
        return self._loop

    def start(self, names: Iterable[str] | None = None) -> None:
        """Start ``names`` (default: every configured server) that are not started yet;
        returns at once (see :meth:`wait_ready`). Raises ``KeyError`` for an unknown name,
        ``RuntimeError`` after :meth:`close`."""
        known = {c.name: c for c in self.configs}
        wanted = list(known) if names is None else list(names)
        for name in wanted:
            if name not in known:
                raise KeyError(f"no MCP server {name!r} in the config")
        with self._lock:
            if self._closed:
                raise RuntimeError("the MCP host is closed")
            loop = self._ensure_loop()
            for name in wanted:
                if name in self._servers and self._servers[name].state != "failed":
                    continue
                server = _Server(known[name])
                self._servers[name] = server
                loop.call_soon_threadsafe(self._spawn, server)

    def _spawn(self, server: _Server) -> None:
        server.task = asyncio.ensure_future(self._run(server))
        timeout = self.start_timeout_s

        def watchdog() -> None:
            if server.state == "starting" and server.task is not None:
                server.fail(f"{server.config.name}: no answer within {timeout:g} s of its start")
                server.task.cancel()

        asyncio.get_running_loop().call_later(timeout, watchdog)

    def wait_ready(self, timeout_s: float | None = None) -> list[ServerStatus]:
        """Wait until every started server is ready or failed (at most ``timeout_s``
        seconds in all); returns :meth:`status`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for server in list(self._servers.values()):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            server.ready.wait(left)
        return self.status()

    def status(self) -> list[ServerStatus]:
        """Every configured server, in config order ("stopped" when not started)."""
        out = []
        for config in self.configs:
            server = self._servers.get(config.name)
            if server is None:
                out.append(ServerStatus(config.name, config.transport, "stopped"))
            else:
                tools = tuple(t for t in self.tools([config.name]))
                out.append(server.status(tools))
        return out

    def close(self, timeout_s: float = 15.0) -> None:
        """Leave every session and stop the loop (idempotent). Stdio servers get their
        stdin closed, then the SDK's SIGTERM/SIGKILL of their process group."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        loop = self._loop
        if loop is None:
            return

        async def stop_all() -> None:
            assert self._stop is not None
            self._stop.set()
            tasks = [s.task for s in self._servers.values() if s.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=timeout_s)
            for t in tasks:
                if not t.done():
                    t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(stop_all(), loop).result(timeout_s + 5)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout_s)
        if not loop.is_running():
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
        for server in self._servers.values():
            if server.stderr is not None:
                server.stderr.close()

    def __enter__(self) -> McpHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one server's task

    def _transport(self, server: _Server, stack: contextlib.AsyncExitStack) -> Any:
        config = server.config
        if config.transport == "stdio":
            from mcp.client.stdio import StdioServerParameters, stdio_client

            server.stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
            params = StdioServerParameters(
                command=config.command, args=list(config.args), env=dict(config.env), cwd=config.cwd
            )
            return stdio_client(params, errlog=server.stderr)
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        http = httpx2.AsyncClient(
            headers=dict(config.headers), timeout=httpx2.Timeout(30.0, read=300.0)
        )
        stack.push_async_callback(http.aclose)
        return streamable_http_client(config.url, http_client=http)

    async def _run(self, server: _Server) -> None:
        from mcp import Client

        name = server.config.name
        try:
            async with contextlib.AsyncExitStack() as stack:
                transport = self._transport(server, stack)
                client = await stack.enter_async_context(Client(transport))
                tools, cursor = [], None
                while True:
                    listing = await client.list_tools(cursor=cursor)
                    tools += listing.tools
                    cursor = listing.next_cursor
                    if not cursor:
                        break
                server.tools, server.client = tools, client
                server.state = "ready"
                server.ready.set()
                assert self._stop is not None
                await self._stop.wait()
                server.client = None
        except asyncio.CancelledError:
            if server.state == "starting":
                server.fail(f"{name}: stopped while starting")
        except BaseException as e:  # noqa: BLE001 -- a server's failure is its status
            if server.state == "starting":
                server.fail(f"{name}: failed to start: {error_text(e)}")
            elif server.state == "ready" and not self._closed:
                server.fail(f"{name}: the session ended: {error_text(e)}")
        finally:
            server.client = None
            if server.state in ("starting", "ready"):
                server.state = "stopped" if server.state == "ready" else "failed"
            server.ready.set()

    # ------------------------------------------------------------------ tools and calls

    def tools(self, servers: Iterable[str] | None = None) -> list[ToolInfo]:
        """The tools of the ready servers among ``servers`` (default: all), named for the
        model over exactly that set (module docstring)."""
        wanted = None if servers is None else set(servers)
        pairs, raw = [], []
        for config in self.configs:
            server = self._servers.get(config.name)
            if server is None or server.state != "ready":
                continue
            if wanted is not None and config.name not in wanted:
                continue
            for t in server.tools:
                pairs.append((config.name, t.name))
                raw.append(t)
        return [
            ToolInfo(s, t.name, fn, t.description or "", dict(t.input_schema or {}))
            for (s, _), t, fn in zip(pairs, raw, function_names(pairs), strict=True)
        ]

    def specs(self, servers: Iterable[str]) -> list[dict[str, Any]]:
        """The OpenAI function tools of ``servers``' tools, for the chat template."""
        return [t.spec() for t in self.tools(servers)]

    def call(self, tool: ToolInfo, arguments: dict[str, Any], timeout_s: float) -> CallHandle:
        """Call ``tool`` with ``arguments``; returns at once. Raises ``RuntimeError`` after
        :meth:`close`."""
        if self._closed or self._loop is None:
            raise RuntimeError("the MCP host is closed")
        future = asyncio.run_coroutine_threadsafe(
            self._call(tool, arguments, timeout_s), self._loop
        )
        return CallHandle(future, tool)

    async def _call(
        self, tool: ToolInfo, arguments: dict[str, Any], timeout_s: float
    ) -> ToolResult:
        server = self._servers.get(tool.server)
        if server is None or server.state != "ready" or server.client is None:
            why = server.error if server is not None and server.error else "it is not running"
            return ToolResult(f"MCP server {tool.server} is not available: {why}", True)
        try:
            async with asyncio.timeout(timeout_s):
                result = await server.client.call_tool(tool.tool, arguments)
        except TimeoutError:
            return ToolResult(
                f"{tool.display} did not answer within {timeout_s:g} s", True, timed_out=True
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- the connection or the protocol failed
            text = error_text(e)
            if "connection closed" in text.lower():
                server.fail(f"{tool.server}: the server closed the connection")
                return ToolResult(f"{tool.display} failed: {server.error}", True)
            return ToolResult(f"{tool.display} failed: {text}", True)
        return ToolResult(result_text(result), bool(result.is_error))


def result_text(result: Any) -> str:
    """An MCP ``CallToolResult`` as text: its text parts joined by newlines; other parts
    (images, audio, resources) named by kind; the structured content as JSON when there
    is no text."""
    import json

    parts = []
    for block in result.content or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(getattr(block, "resource", None), "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{kind or 'content'} omitted]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)
