"""MCP servers for tests: one written here with the SDK's ``MCPServer`` (FastMCP in mcp 1.x),
run as a stdio subprocess or over streamable HTTP, and the npm filesystem server.

Tools of the test server: ``echo`` (text back), ``fail`` (raises: an error result),
``slow`` (sleeps ``seconds``: a call to cancel or time out), ``crash`` (the process exits
mid-call), ``hang`` (never answers: a timeout), ``pid`` (the server's process id).

Run as a script: ``python tests/mcp_kit.py`` serves stdio; ``python tests/mcp_kit.py PORT``
serves streamable HTTP at ``http://127.0.0.1:PORT/mcp``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FS_PACKAGE = "@modelcontextprotocol/server-filesystem@2026.8.31"


def build_server():
    import anyio
    from mcp.server.mcpserver import MCPServer

    app = MCPServer("kit")

    @app.tool()
    def echo(text: str) -> str:
        """Return the text, prefixed."""
        return "echo: " + text

    @app.tool()
    def fail(reason: str) -> str:
        """Raise an error with the reason."""
        raise ValueError(reason)

    @app.tool()
    async def slow(seconds: float) -> str:
        """Sleep for some seconds, then answer."""
        await anyio.sleep(seconds)
        return f"slept {seconds}"

    @app.tool()
    def crash() -> str:
        """Exit the server process mid-call."""
        print("kit server: crashing on purpose", file=sys.stderr, flush=True)
        os._exit(3)

    @app.tool()
    async def hang() -> str:
        """Never answer."""
        await anyio.sleep_forever()
        return ""

    @app.tool()
    def pid() -> str:
        """The server's process id."""
        return str(os.getpid())

    return app


def stdio_config(name: str = "kit"):
    """A :class:`~tierchat.core.tools.config.ServerConfig` running this file over stdio."""
    from tierchat.core.tools.config import ServerConfig

    return ServerConfig(name, "stdio", command=sys.executable, args=(str(Path(__file__)),))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpServer:
    """This file's server over streamable HTTP in a subprocess; ``url`` once started.
    Waits for the port to accept (a connection, not a sleep), up to ``timeout_s``."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("the HTTP MCP test server did not start") from None
                time.sleep(0.05)  # polling a port that is not open yet: no event to wait on

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def fs_cache_dir() -> Path:
    env = os.environ.get("TIERCHAT_MCP_NPM_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tierchat-mcp" / FS_PACKAGE.replace("/", "_")


def install_filesystem_server(timeout_s: float = 300) -> Path:
    """The npm filesystem MCP server's entry point (``dist/index.js``), installed into
    :func:`fs_cache_dir` on first use. Skips the calling test (with the reason) when node
    or npm is missing or the install fails."""
    import pytest

    root = fs_cache_dir()
    entry = (
        root / "node_modules" / "@modelcontextprotocol" / "server-filesystem" / "dist" / "index.js"
    )
    if entry.exists():
        return entry
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"the filesystem MCP server needs {tool}, which is not on PATH")
    root.mkdir(parents=True, exist_ok=True)
    cmd = ["npm", "install", "--prefix", str(root), "--no-audit", "--no-fund", FS_PACKAGE]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install of {FS_PACKAGE} took over {timeout_s:.0f} s (no network?)")
    if r.returncode != 0 or not entry.exists():
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        pytest.skip(f"npm install of {FS_PACKAGE} failed (exit {r.returncode}): {tail}")
    return entry


if __name__ == "__main__":
    server = build_server()
    print("kit server: starting", file=sys.stderr, flush=True)
    if len(sys.argv) > 1:
        server.run(transport="streamable-http", port=int(sys.argv[1]))
    else:
        server.run()
