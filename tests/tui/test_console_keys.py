"""Daily-driver keys as a terminal sends them (tmux, real bytes): regenerate an earlier
reply, continue a cut reply, recall earlier prompts. The app is ``tests/tui/fake_app.py``
(the real app, store and keys over the fake engine) in a tmux pane
(``test_terminal_keys.TmuxTerminal``); effects are checked in the SQLite store and on the
pane.

``CONSOLE_BINDINGS`` is every ``(binding id, key)`` these tests type; the main key test
(``test_every_binding_in_the_help_is_typed``) counts them as typed.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from test_terminal_keys import TmuxTerminal, replies

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="needs a pty"),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]

CONSOLE_BINDINGS: frozenset[tuple[str, str]] = frozenset()


def reply_rows(term: TmuxTerminal) -> list[tuple[int, int, int]]:
    """``(id, parent_id, prompt_tokens)`` of every reply, oldest first."""
    rows = term.rows("SELECT id, parent_id, meta FROM nodes WHERE role='assistant' ORDER BY id")
    return [(i, p, json.loads(m)["prompt_tokens"]) for i, p, m in rows]


def test_r_on_an_earlier_reply_regenerates_that_reply(tmp_path):
    term = TmuxTerminal(tmp_path, args=("--token-delay", "0.01"))
    try:
        for text in (b"first question", b"second question, a longer one than the first"):
            before = replies(term)
            term.write(text + b"\r")
            term.until(lambda: replies(term) > before, "a reply")
            term.wait_for(lambda r: r.get("streaming") is False, "the reply to finish")
        (first, user1, prompt1), (second, user2, prompt2) = reply_rows(term)
        assert prompt2 > prompt1

        term.write(b"\x1b[1;3A")  # alt+up: the cursor on the last reply
        term.wait_for(lambda r: r.get("action") == "select(-1)", "the cursor")
        term.press("up", "screen.select(-1)")  # the second user message
        term.press("up", "screen.select(-1)")  # the first reply
        term.press("r", "screen.regenerate")
        term.until(lambda: replies(term) == 3, "the new reply")
        term.wait_for(lambda r: r.get("streaming") is False, "the reply to finish")

        new, parent, prompt = reply_rows(term)[-1]
        assert parent == user1, "the new reply is a sibling of the first reply"
        assert prompt == prompt1, "its prompt is the first reply's prompt"
        selected = term.rows("SELECT selected_child FROM nodes WHERE id = ?", (user1,))
        assert selected == [(new,)]
        screen = term.until(lambda: "2/2" in term.screen() and term.screen(), "2/2 shown")
        assert "second question" not in screen  # the path ends at the new reply
    finally:
        term.close()
