"""mcp.json: the Claude Desktop / Cursor / LM Studio notation read into server configs, and
malformed files named by file and key (core/tools/config.py)."""

from __future__ import annotations

import json

import pytest
from tierchat.core.tools.config import McpConfigError, load_servers, parse_servers


def test_stdio_and_http_entries_in_file_order(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "files": {"command": "npx", "args": ["-y", "pkg", "."], "env": {"A": "1"}},
                    "off": {"command": "x", "disabled": True},
                    "web": {"url": "http://127.0.0.1:9/mcp", "headers": {"Authorization": "B x"}},
                }
            }
        )
    )
    files, web = load_servers(path, explicit=True)
    assert (files.name, files.transport, files.command, files.args) == (
        "files",
        "stdio",
        "npx",
        ("-y", "pkg", "."),
    )
    assert dict(files.env) == {"A": "1"}
    assert (web.name, web.transport, web.url, dict(web.headers)) == (
        "web",
        "http",
        "http://127.0.0.1:9/mcp",
        {"Authorization": "B x"},
    )


def test_missing_default_file_is_no_servers_but_a_named_one_is_an_error(tmp_path):
    assert load_servers(tmp_path / "mcp.json", explicit=False) == []
    with pytest.raises(McpConfigError, match="does not exist"):
        load_servers(tmp_path / "mcp.json", explicit=True)


@pytest.mark.parametrize(
    "data, where",
    [
        ({"servers": {}}, "mcpServers"),
        ({"mcpServers": {"a": {"args": []}}}, "mcpServers.a: give either"),
        ({"mcpServers": {"a": {"command": "x", "url": "http://h"}}}, "mcpServers.a: give either"),
        ({"mcpServers": {"a": {"command": "x", "args": "-y"}}}, "mcpServers.a.args"),
        ({"mcpServers": {"a": {"command": "x", "env": {"A": 1}}}}, "mcpServers.a.env"),
        ({"mcpServers": {"a": {"url": "ftp://h"}}}, "mcpServers.a.url"),
        ({"mcpServers": {"a": {"url": "http://h", "type": "sse"}}}, "mcpServers.a.type"),
        ({"mcpServers": {"a b": {"command": "x"}}}, "mcpServers.a b"),
        ({"mcpServers": {"a": []}}, "mcpServers.a must be an object"),
    ],
)
def test_malformed_entries_name_the_file_and_the_key(data, where):
    with pytest.raises(McpConfigError) as e:
        parse_servers(data, "/x/mcp.json")
    assert str(e.value).startswith("/x/mcp.json")
    assert where in str(e.value)


def test_invalid_json_names_the_file_and_the_place(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text('{"mcpServers": {,}}')
    with pytest.raises(McpConfigError, match=r"mcp.json is not valid JSON: .*line 1"):
        load_servers(path, explicit=False)
