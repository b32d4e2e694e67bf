"""The keys of the chat tools (screens/chat/tools.py) as a terminal sends them: the real
app on the fake engine in a pty (``test_terminal_keys.Terminal``), typed as bytes.

``TOOL_BINDINGS`` is every ``(binding id, key)`` this file types; the main key test
(``test_every_binding_in_the_help_is_typed``) counts them as typed, and
:func:`test_every_tool_binding_is_typed` fails when one of them is not typed here.
"""

from __future__ import annotations

import json
import stat
import sys

import pytest
from test_terminal_keys import Terminal, help_bindings, replies

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a pty")

TOOL_BINDINGS: frozenset[tuple[str, str]] = frozenset(
    {
        ("search", "ctrl+f"),
        ("search_scope", "ctrl+t"),
        ("search_next", "down"),
        ("search_prev", "up"),
        ("search_cancel", "escape"),
        ("edit_in_editor", "ctrl+g"),
        ("clear_input", "ctrl+l"),
        ("import_conversation", "ctrl+o"),
        ("raw_message", "v"),
        ("raw_copy_all", "a"),
        ("raw_close", "q"),
        ("raw_close", "escape"),
        ("copy_code", "y"),
        ("code_cancel", "escape"),
        *{(f"code_{n}", str(n)) for n in range(1, 10)},
        ("delete_message", "d"),
        ("delete_branch", "D"),
        ("verify_turn", "V"),
    }
)

BLOCKS = "blocks:\n" + "\n".join(f"```\nblock {n}\n```" for n in range(1, 10))


def test_every_tool_binding_is_typed(tmp_path, monkeypatch):
    editor = tmp_path / "editor.py"
    editor.write_text(
        f"#!{sys.executable}\nimport sys\nopen(sys.argv[1], 'w').write({BLOCKS!r} + '\\n')\n"
    )
    editor.chmod(editor.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("VISUAL", str(editor))
    export = tmp_path / "export.json"
    export.write_text(
        json.dumps(
            {
                "format": "tierchat-conversation",
                "version": 1,
                "title": "imported",
                "messages": [
                    {"role": "user", "content": "an imported question"},
                    {"role": "assistant", "content": "an imported answer"},
                ],
            }
        )
    )
    term = Terminal(tmp_path)
    bindings = help_bindings()
    typed: set[tuple[str, str]] = set()

    def press(binding_id: str, key: str, *, ok: bool = True) -> dict:
        record = term.press(key, bindings[(binding_id, key)], ok=ok)
        typed.add((binding_id, key))
        return record

    def count(sql: str) -> int:
        return term.rows(sql)[0][0]

    try:
        # -- long prompts: $EDITOR (the app hands the terminal over), clear, again, send
        term.write(b"draft")
        press("edit_in_editor", "ctrl+g")
        press("clear_input", "ctrl+l")
        press("edit_in_editor", "ctrl+g")
        term.write(b"\r")
        term.wait_for(lambda r: r.get("action") == "send", "send")
        term.until(lambda: replies(term) == 1, "the reply")
        term.wait_for(lambda r: r.get("streaming") is False, "the reply to finish")
        (stored,) = term.rows("SELECT content FROM nodes WHERE role = 'user'")
        assert stored == (BLOCKS,)

        # -- one message: raw text, copy a code block
        term.press("escape", "to_messages")  # onto the messages (the reply)
        term.press("up", "select(-1)")  # the user message
        press("raw_message", "v")
        term.wait_for(lambda r: r.get("focus") == "TextArea", "the raw text")
        press("raw_copy_all", "a")
        press("raw_close", "q")
        press("raw_message", "v")
        press("raw_close", "escape")
        for n in range(1, 10):
            press("copy_code", "y")
            term.wait_for(lambda r: r.get("focus") == "OptionList", "the block list")
            press(f"code_{n}", str(n))
        press("copy_code", "y")
        press("code_cancel", "escape")

        # -- verify the reply against cold (the fake engine answers it or says it cannot)
        term.press("down", "select(1)")  # the reply
        press("verify_turn", "V")

        # -- search
        press("search", "ctrl+f")
        term.wait_for(lambda r: r.get("focus") == "Input", "the search input")
        term.write(b"block")
        press("search_scope", "ctrl+t")
        press("search_next", "down")
        press("search_prev", "up")
        press("search_cancel", "escape")

        # -- delete: cancel one message, then the branch from the reply on
        term.press("end", "select_edge(1)")
        press("delete_message", "d")
        term.press("n", "cancel")
        press("delete_branch", "D")
        term.press("y", "confirm")
        term.until(lambda: count("SELECT count(*) FROM nodes") == 1, "the delete")

        # -- import an export
        press("import_conversation", "ctrl+o")
        term.wait_for(lambda r: r.get("focus") == "Input", "the path prompt")
        term.write(str(export).encode() + b"\r")
        term.until(lambda: count("SELECT count(*) FROM conversations") == 2, "the import")
        assert term.rows("SELECT content FROM nodes ORDER BY id")[-1] == ("an imported answer",)
    finally:
        term.close()
    assert typed == TOOL_BINDINGS
