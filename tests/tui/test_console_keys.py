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

CONSOLE_BINDINGS: frozenset[tuple[str, str]] = frozenset(
    {
        ("continue_reply", "alt+c"),
        ("recall_prev", "up"),
        ("recall_next", "down"),
        ("undo_delete", "u"),
        ("undo_delete_list", "u"),
    }
)


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
            term.until(lambda before=before: replies(term) > before, "a reply")
            term.wait_for(lambda r: r.get("streaming") is False, "the reply to finish")
        (first, user1, prompt1), (second, user2, prompt2) = reply_rows(term)
        assert prompt2 > prompt1

        term.write(b"\x1b[1;3A")  # alt+up: the cursor on the last reply
        term.wait_for(lambda r: r.get("action") == "select(-1)", "the cursor")
        term.press("up", "select(-1)")  # the second user message
        term.press("up", "select(-1)")  # the first reply
        term.press("r", "regenerate")
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


def test_continue_recall_and_context_in_the_input(tmp_path):
    """Alt+C continues a reply cut at max tokens (the reply grows in place, one swipe;
    prompt = the cut reply's prompt + its ids); ↑/↓ on the input's edge lines walk the
    prompts sent and come back to the draft; the empty input's border shows the context
    the conversation uses."""
    term = TmuxTerminal(tmp_path, args=("--token-delay", "0.005"))
    try:
        term.write(b"short one\r")
        term.until(lambda: replies(term) == 1, "a reply")
        term.wait_for(lambda r: r.get("streaming") is False, "the reply to finish")
        long = b"a question long enough that the fake reply runs past sixty-four tokens"
        term.write(long + b"\r")
        term.until(lambda: replies(term) == 2, "a reply")
        term.wait_for(lambda r: r.get("streaming") is False, "the reply to finish")
        cut_id, user_id = term.rows(
            "SELECT id, parent_id FROM nodes WHERE role='assistant' ORDER BY id DESC LIMIT 1"
        )[0]
        meta = json.loads(term.rows("SELECT meta FROM nodes WHERE id=?", (cut_id,))[0][0])
        assert meta["finish_reason"] == "length"

        cut_ids = json.loads(term.rows("SELECT token_ids FROM nodes WHERE id=?", (cut_id,))[0][0])
        term.press("alt+c", "continue_reply")

        def grown() -> bool:
            row = term.rows("SELECT meta FROM nodes WHERE id=?", (cut_id,))[0][0]
            return json.loads(row).get("continued") == 1

        term.until(grown, "the reply grown in place")
        term.wait_for(lambda r: r.get("streaming") is False, "the reply to finish")
        assert replies(term) == 2, "no new sibling: the cut reply grew"
        parent, ids, new_meta = term.rows(
            "SELECT parent_id, token_ids, meta FROM nodes WHERE id=?", (cut_id,)
        )[0]
        new_meta = json.loads(new_meta)
        assert parent == user_id and len(json.loads(ids)) > len(cut_ids)
        assert json.loads(ids)[: len(cut_ids)] == cut_ids
        assert new_meta["prompt_tokens"] == meta["prompt_tokens"] + len(cut_ids)
        assert "2/2" not in term.screen()

        # ↑ recalls the prompts sent (newest first), ↓ comes back to the draft
        term.write(b"draft")
        term.until(lambda: "draft" in term.screen(), "the draft")
        term.press("up", "recall(-1)")
        term.until(lambda: long.decode()[:40] in term.screen(), "the last prompt")
        term.press("up", "recall(-1)")
        term.until(lambda: "short one" in term.screen().splitlines()[-4:][0] + term.screen(),
                   "the first prompt")  # fmt: skip
        term.press("down", "recall(1)")
        term.press("down", "recall(1)")
        term.until(lambda: "draft" in term.screen(), "the draft again")
        term.write(b"\x0c")  # ctrl+l: empty the input
        term.until(lambda: "context " in term.screen(), "the context in the border")
    finally:
        term.close()


def test_u_undoes_a_deleted_branch_and_a_deleted_conversation(tmp_path):
    term = TmuxTerminal(tmp_path)
    try:
        for text in (b"keep me", b"delete me"):
            before = replies(term)
            term.write(text + b"\r")
            term.until(lambda before=before: replies(term) > before, "a reply")
            term.wait_for(lambda r: r.get("streaming") is False, "the reply to finish")
        count = "SELECT count(*) FROM nodes"
        nodes = term.rows(count)[0][0]
        term.press("escape", "to_messages")  # the cursor on the last reply
        term.press("up", "select(-1)")  # "delete me"
        term.press("D", "delete_branch")
        term.press("y", "confirm")
        term.until(lambda: term.rows(count)[0][0] == nodes - 2, "the branch deleted")
        term.press("u", "screen.undo_delete")
        term.until(lambda: term.rows(count)[0][0] == nodes, "the branch back")
        assert "delete me" in [r[0] for r in term.rows("SELECT content FROM nodes")]
        term.until(lambda: "delete me" in term.screen(), "the branch shown again")

        term.press("f3", "toggle_conversations")
        term.press("f3", "toggle_conversations")  # shown again, with the focus
        term.press("delete", "screen.delete_conversation")
        term.press("y", "confirm")
        term.until(lambda: term.rows("SELECT count(*) FROM conversations")[0][0] == 0, "deleted")
        term.press("u", "screen.undo_delete")
        term.until(lambda: term.rows("SELECT count(*) FROM conversations")[0][0] == 1, "back")
        assert term.rows(count)[0][0] == nodes
        term.until(lambda: "keep me" in term.screen(), "the conversation shown again")
    finally:
        term.close()
