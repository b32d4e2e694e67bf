"""Tool rounds typed as a terminal sends them (docs/DESIGN.md §16): the real app in a tmux
pane (``test_terminal_keys.TmuxTerminal``), the fake engine speaking ``tiny:qwen2``'s
tokenizer with recorded calls (``fake_app.py --tool-replies``), the tools on the MCP test
server (tests/mcp_kit.py). Every key of the approval dialog is typed as bytes (``y``, ``n``
and a reason, Esc, ``a``), then Esc cancels a running call.

``APPROVAL_BINDINGS`` is every ``(binding id, key)`` typed here; the main key test counts
them as typed."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from test_terminal_keys import TmuxTerminal, help_bindings

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="needs a pty"),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]

APPROVAL_BINDINGS: frozenset[tuple[str, str]] = frozenset(
    {
        ("tool_allow_once", "y"),
        ("tool_allow_always", "a"),
        ("tool_deny", "n"),
        ("tool_deny_now", "escape"),
    }
)


def call_text(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


REPLIES = [
    call_text("echo", '{"text": "one"}'),
    "Answer one.",
    call_text("echo", '{"text": "two"}'),
    "Answer two.",
    call_text("echo", '{"text": "three"}'),
    "Answer three.",
    call_text("slow", '{"seconds": 120}'),
    "never asked for",
]


def test_approval_keys_and_esc_on_a_running_call(tmp_path, models_dir):
    replies_file = tmp_path / "replies.json"
    replies_file.write_text(json.dumps(REPLIES))
    args = ("--tool-replies", str(replies_file), "--models-dir", str(models_dir))
    term = TmuxTerminal(tmp_path, args=args)
    bindings = help_bindings()

    def press(binding_id: str, key: str) -> None:
        term.press(key, bindings[(binding_id, key)])

    def tools() -> list[tuple[str, dict]]:
        rows = term.rows("SELECT content, meta FROM nodes WHERE role = 'tool' ORDER BY id")
        return [(content, json.loads(meta)) for content, meta in rows]

    def ask(text: str) -> None:
        term.write(text.encode() + b"\r")
        term.wait_for(lambda r: r.get("action") == "send", "send")
        term.wait_for(
            lambda r: "focus" in r and r.get("screen") == "ToolApprovalScreen", "the approval"
        )

    def answered(n: int) -> None:
        term.until(lambda: len(tools()) == n, f"{n} tool results")
        term.wait_for(lambda r: r.get("streaming") is False, "the round to end")

    try:
        term.wait_for(lambda r: r.get("tools_ready"), "the MCP server")
        ask("first")
        press("tool_allow_once", "y")
        answered(1)
        ask("second")
        press("tool_deny", "n")
        term.wait_for(lambda r: r.get("focus") == "Input", "the reason")
        term.write(b"not now\r")
        answered(2)
        ask("third")
        press("tool_deny_now", "escape")
        answered(3)
        ask("fourth")
        press("tool_allow_always", "a")
        term.until(lambda: "running" in term.screen(), "the running call")
        term.press("escape", "stop")
        answered(4)
        (once, _), (denied, denied_meta), (now, now_meta), (stopped, stopped_meta) = tools()
        assert once == "echo: one"
        assert denied == "the user denied this call: not now" and denied_meta["denied"]
        assert now == "the user denied this call" and now_meta["denied"]
        assert stopped_meta["cancelled"] and stopped_meta["tool"] == "slow"
        answers = term.rows("SELECT content FROM nodes WHERE role = 'assistant' ORDER BY id")
        assert [a for (a,) in answers if a] == ["Answer one.", "Answer two.", "Answer three."]
        (allowed,) = term.rows("SELECT settings FROM conversations ORDER BY id DESC LIMIT 1")
        assert "kit.slow" in allowed[0]
    finally:
        term.close()
