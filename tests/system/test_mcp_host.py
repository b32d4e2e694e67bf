"""The MCP host against real servers (core/tools/mcp_host.py): the test server of
``tests/mcp_kit.py`` over stdio and streamable HTTP (text, an error, a slow call cancelled,
a crash mid-call, a call that never answers), servers that fail to start, a clean close,
and the npm filesystem server listing and reading a real file."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
from mcp_kit import HttpServer, install_filesystem_server, stdio_config
from tierchat.core.tools.config import ServerConfig
from tierchat.core.tools.mcp_host import McpHost, ToolInfo


def _tool(host, name):
    return next(t for t in host.tools() if t.tool == name)


@pytest.fixture(params=["stdio", "http"])
def kit(request):
    """A started host with the kit server over one transport."""
    if request.param == "stdio":
        host = McpHost([stdio_config()])
        server = None
    else:
        server = HttpServer()
        host = McpHost([ServerConfig("kit", "http", url=server.url)])
    host.start()
    (status,) = host.wait_ready(60)
    assert status.state == "ready", status.error
    try:
        yield host
    finally:
        host.close()
        if server is not None:
            server.close()


def test_tools_are_listed_with_their_server(kit):
    names = [t.display for t in kit.tools()]
    assert names == ["kit.echo", "kit.fail", "kit.slow", "kit.crash", "kit.hang", "kit.pid"]
    spec = _tool(kit, "echo").spec()
    assert spec["function"]["name"] == "echo"
    assert spec["function"]["parameters"]["properties"]["text"]["type"] == "string"


def test_text_and_error_results(kit):
    ok = kit.call(_tool(kit, "echo"), {"text": "hi"}, 30).result()
    assert (ok.text, ok.is_error) == ("echo: hi", False)
    bad = kit.call(_tool(kit, "fail"), {"reason": "nope"}, 30).result()
    assert bad.is_error and not bad.cancelled


def test_a_cancelled_call_returns_at_once_marked_and_the_server_goes_on(kit):
    handle = kit.call(_tool(kit, "slow"), {"seconds": 600}, 900)
    handle.cancel()
    result = handle.result(timeout=5)  # the wait is bounded: a cancel never hangs
    assert result.cancelled and result.is_error
    assert kit.call(_tool(kit, "echo"), {"text": "after"}, 30).result().text == "echo: after"


def test_a_call_that_never_answers_times_out(kit):
    result = kit.call(_tool(kit, "hang"), {}, 0.5).result(timeout=30)
    assert result.timed_out and result.is_error and "did not answer within 0.5 s" in result.text
    assert kit.call(_tool(kit, "echo"), {"text": "x"}, 30).result().text == "echo: x"


def test_a_stdio_server_that_crashes_mid_call_is_an_error_with_its_stderr():
    with McpHost([stdio_config()]) as host:
        host.start()
        host.wait_ready(60)
        result = host.call(_tool(host, "crash"), {}, 60).result(timeout=60)
        assert result.is_error and "closed the connection" in result.text
        assert "crashing on purpose" in result.text  # the stderr tail
        (status,) = host.status()
        assert status.state == "failed"
        assert host.tools() == []  # a failed server lists nothing
        stale = ToolInfo("kit", "echo", "echo", "", {})
        again = host.call(stale, {"text": "x"}, 5).result(timeout=30)
        assert again.is_error and "not available" in again.text


def test_servers_that_fail_to_start_say_why_and_never_hang():
    servers = [
        ServerConfig("missing", "stdio", command="/nonexistent/server"),
        ServerConfig(
            "exits",
            "stdio",
            command=sys.executable,
            args=("-c", "import sys; print('bad flag --x', file=sys.stderr); sys.exit(2)"),
        ),
        ServerConfig(
            "silent", "stdio", command=sys.executable, args=("-c", "import time; time.sleep(600)")
        ),
        ServerConfig("refused", "http", url="http://127.0.0.1:1/mcp"),
    ]
    with McpHost(servers, start_timeout_s=3) as host:
        host.start()
        statuses = {s.name: s for s in host.wait_ready(60)}
    assert all(s.state == "failed" for s in statuses.values()), statuses
    assert "No such file" in statuses["missing"].error
    assert "bad flag --x" in statuses["exits"].error  # its stderr tail
    assert "no answer within 3 s" in statuses["silent"].error
    assert (
        "refused" in statuses["refused"].error.lower()
        or "connect" in statuses["refused"].error.lower()
    )


def test_close_stops_stdio_servers_and_leaves_no_warning(caplog):
    caplog.set_level("WARNING")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        host = McpHost([stdio_config("a"), stdio_config("b")])
        host.start()
        host.wait_ready(60)
        pids = [int(host.call(_tool_on(host, s), {}, 30).result().text) for s in ("a", "b")]
        host.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone (reaped by the SDK's transport)
    # no "Task was destroyed but it is pending", no unclosed transport
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("asyncio", "mcp"))] == []


def _tool_on(host, server):
    return next(t for t in host.tools([server]) if t.tool == "pid")


def test_the_npm_filesystem_server_lists_and_reads_a_real_file(tmp_path):
    entry = install_filesystem_server()
    (tmp_path / "notes.txt").write_text("hello from a real file\n")
    config = ServerConfig("files", "stdio", command="node", args=(str(entry), str(tmp_path)))
    with McpHost([config]) as host:
        host.start()
        (status,) = host.wait_ready(120)
        assert status.state == "ready", status.error
        names = {t.tool for t in host.tools()}
        assert {"read_text_file", "list_directory"} <= names
        listing = host.call(_tool(host, "list_directory"), {"path": str(tmp_path)}, 60).result()
        assert "notes.txt" in listing.text and not listing.is_error
        read = host.call(
            _tool(host, "read_text_file"), {"path": str(tmp_path / "notes.txt")}, 60
        ).result()
        assert read.text.strip() == "hello from a real file"
