"""The TUI's MCP host from the settings (cli/main.py ``mcp_host``): none without servers, a
host not yet started (the app starts it) for a file that names some, exit 2 with the file
and the key for a malformed one (docs/DESIGN.md §12.1, §16)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tierchat.cli.common import EXIT_USAGE, CLIError
from tierchat.cli.main import mcp_host
from tierchat.config.settings import Settings


def settings(tmp_path, data) -> Settings:
    path = tmp_path / "mcp.json"
    if data is not None:
        path.write_text(json.dumps(data))
    return dataclasses.replace(Settings(), mcp_config=path)


def test_servers_give_a_host_not_started(tmp_path):
    host = mcp_host(settings(tmp_path, {"mcpServers": {"kit": {"command": "true"}}}))
    assert [c.name for c in host.configs] == ["kit"]
    assert [s.state for s in host.status()] == ["stopped"]


def test_no_servers_give_no_host(tmp_path):
    assert mcp_host(settings(tmp_path, {"mcpServers": {}})) is None


@pytest.mark.parametrize(
    ("data", "said"),
    [(None, "does not exist"), ({"mcpServers": {"x": {}}}, "mcpServers.x")],
)
def test_a_bad_file_is_exit_2(tmp_path, data, said):
    with pytest.raises(CLIError) as e:
        mcp_host(settings(tmp_path, data))
    assert e.value.code == EXIT_USAGE and said in e.value.message
