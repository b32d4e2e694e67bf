"""``tierchat chat`` with MCP tools: the test server of ``tests/mcp_kit.py`` over stdio from
an ``--mcp-config`` file, ``tiny:qwen2`` with recorded replies (``engine_kit.ScriptedEngine``),
approval typed on stdin (y/n/a), ``/tools``, and the cache line of each round."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from engine_kit import ScriptedEngine
from tierchat.cli.main import main

pytestmark = pytest.mark.usefixtures("isolated_settings")
KIT = Path(__file__).resolve().parents[1] / "mcp_kit.py"


def call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


@pytest.fixture
def argv(tmp_path, models_dir) -> list[str]:
    config = tmp_path / "mcp.json"
    config.write_text(
        json.dumps({"mcpServers": {"kit": {"command": sys.executable, "args": [str(KIT)]}}})
    )
    return [
        "chat",
        "--model",
        "tiny:qwen2",
        "--block-size",
        "16",
        "--cache-dir",
        str(tmp_path / "kv"),
        "--data-dir",
        str(tmp_path / "data"),
        "--models-dir",
        str(models_dir),
        "--max-tokens",
        "96",
        "--mcp-config",
        str(config),
    ]


def scripted(monkeypatch, replies: list[str]) -> None:
    import tierchat.cli.chat as chat

    real = chat.start_engine
    monkeypatch.setattr(chat, "start_engine", lambda s: ScriptedEngine(real(s), replies))


def test_line_chat_runs_rounds_with_y_n_a_approval(capsys, monkeypatch, argv):
    scripted(
        monkeypatch,
        [
            call("echo", {"text": "hi"}),
            "It said: echo: hi.",
            call("echo", {"text": "again"}),
            "Fine, no tool.",
            call("echo", {"text": "always"}),
            "Done.",
            call("echo", {"text": "no question"}),
            "Done again.",
            call("write_file", {"path": "x"}),
            "That tool does not exist.",
        ],
    )
    lines = [
        "Say hi through echo.",
        "y",
        "Again.",
        "n",
        "not now",
        "Once more.",
        "a",
        "And again.",
        "Break something.",
        "/tools",
        "/tools off kit",
        "/tools on nope",
        "/quit",
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in out + err
    assert out.count("? [y]es once, [n]o, [a]lways: ") == 3  # y, n, a; then allowed
    assert "[tool kit.echo → ok: echo: hi]" in out
    assert "[tool kit.echo → denied: the user denied this call: not now]" in out
    assert "[tool kit.echo → ok: echo: no question]" in out
    assert "[tool write_file → error: error: there is no tool named 'write_file'" in out
    assert "It said: echo: hi." in out and "That tool does not exist." in out
    assert "[on  kit (stdio, ready)]" in out and "kit.echo: Return the text, prefixed." in out
    assert "[off kit (stdio, ready)]" in out
    assert "no MCP server 'nope'" in err

    # the round's line: the previous prompt and the call were restored, the result and
    # the generation prompt prefilled
    cost = re.findall(r"\[cached (\d+)/(\d+).*? · prefilled (\d+) · .*? · (\d+) tokens at", out)
    (c1, p1, f1, g1), (c2, p2, f2, _) = [tuple(map(int, m)) for m in cost[:2]]
    assert (c1, f1) == (0, p1)
    assert c2 >= p1 + g1 and f2 == p2 - c2  # only the result and the generation prompt


def test_calls_do_not_stream_as_text_and_a_continue_completes_a_cut_call(capsys, monkeypatch, argv):
    fenced = f"```json\n{json.dumps({'name': 'echo', 'arguments': {'text': 'hi'}})}\n```"
    cut = call("echo", {"text": "cut"})
    at = cut.index('"arguments"') + 5
    scripted(
        monkeypatch,
        [fenced, "It said: echo: hi.", cut[:at], cut[at:], "Done: echo: cut.", '{"a": ', "1}"],
    )
    lines = ["Echo hi.", "y", "Echo cut.", "/continue", "y", "Some JSON.", "/continue", "/quit"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    replies = out.split("assistant> ")[1:]
    assert len(replies) == 7, out
    # the fenced call and the continued end of the cut one are held back, not streamed;
    # the round prints each call as a block
    assert replies[0].startswith("\n[cached") and "```" not in out
    assert '[tool call: kit.echo {"text": "hi"}]' in replies[0]
    assert replies[2].startswith(cut[:at])  # cut inside the call: text, and no round yet
    assert "[tool call" not in replies[2]
    assert replies[3].startswith("\n[cached") and "</tool_call>" not in out
    assert "[tool kit.echo → ok: echo: cut]" in replies[3]
    assert replies[4].startswith("Done: echo: cut.")
    # a cut reply that looked like a bare call and was none: each part printed once
    assert replies[5].startswith('{"a": \n[cached') and replies[6].startswith("1}\n[cached")

    # the round after the fenced call restored the prompt and the reply as generated
    cost = re.findall(r"\[cached (\d+)/(\d+).*? · prefilled (\d+) · .*? · (\d+) tokens at", out)
    (c1, p1, f1, g1), (c2, p2, f2, _) = [tuple(map(int, m)) for m in cost[:2]]
    assert c2 >= p1 + g1 and f2 == p2 - c2


def test_a_malformed_mcp_config_is_a_usage_error(capsys, tmp_path, argv):
    bad = tmp_path / "bad.json"
    bad.write_text('{"mcpServers": {"x": {"command": 3}}}')
    argv[argv.index("--mcp-config") + 1] = str(bad)
    code = main(argv)
    _, err = capsys.readouterr()
    assert code == 2
    assert err.strip() == f"error: {bad}: mcpServers.x.command must be a non-empty string"
