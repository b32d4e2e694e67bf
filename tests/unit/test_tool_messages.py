"""Tool rounds as messages of the tree (core/chat/store.py role "tool", schema 5): a store
of schema 3 migrates with its messages and search index, and fork, delete/undo, search and
export/import (JSON and Markdown) carry the calls and results."""

from __future__ import annotations

import sqlite3

from tierchat.core.chat import sqlite as schema
from tierchat.core.chat.importer import parse_export
from tierchat.core.chat.store import ConversationStore
from tierchat.core.chat.trash import Trash
from tierchat.tui.export import export_conversation

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "echo", "arguments": '{"text": "hi"}'},
}
RESULT_META = {
    "tool_call_id": "call_1",
    "name": "echo",
    "server": "kit",
    "tool": "echo",
    "arguments": '{"text": "hi"}',
    "is_error": False,
    "cancelled": False,
    "timed_out": False,
    "denied": False,
}


def round_trip(store: ConversationStore) -> tuple[int, list[int]]:
    cid = store.create_conversation("tools")
    user = store.add_node(cid, None, "user", "say hi")
    step = store.add_node(
        cid, user.id, "assistant", "", token_ids=(5, 6), meta={"tool_calls": [CALL]}
    )
    result = store.add_node(cid, step.id, "tool", "echo: okapi", meta=RESULT_META)
    answer = store.add_node(cid, result.id, "assistant", "It said so.")
    return cid, [user.id, step.id, result.id, answer.id]


def test_a_schema_4_store_migrates_keeping_messages_and_search(tmp_path):
    path = tmp_path / "c.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA foreign_keys=ON")
    for step in schema.MIGRATIONS[:4]:
        for sql in schema._statements(step):
            conn.execute(sql)
    conn.execute("PRAGMA user_version = 4")
    conn.execute("INSERT INTO conversations (id, created_at, updated_at) VALUES (1, 0, 0)")
    conn.execute(
        "INSERT INTO nodes (id, conversation_id, parent_id, role, content, created_at, "
        "selected_child) VALUES (1, 1, NULL, 'user', 'zebra question', 0, 2)"
    )
    conn.execute(
        "INSERT INTO nodes (id, conversation_id, parent_id, role, content, created_at) "
        "VALUES (2, 1, 1, 'assistant', 'giraffe answer', 0)"
    )
    conn.close()
    with ConversationStore(path) as store:
        assert store.schema_version == schema.SCHEMA_VERSION == 5
        assert [(n.id, n.role) for n in store.active_path(1)] == [(1, "user"), (2, "assistant")]
        assert [h.node_id for h in store.search("giraffe")] == [2]
        store.add_node(1, 2, "tool", "okapi result")
        assert [h.role for h in store.search("okapi")] == ["tool"]
        store.delete_subtree(1)  # cascades inside the rebuilt table
        assert store.search("zebra") == [] and store.search("okapi") == []


def test_fork_delete_undo_and_search_carry_tool_messages():
    with ConversationStore(":memory:") as store:
        cid, (user, step, result, answer) = round_trip(store)
        (hit,) = store.search("okapi")
        assert (hit.node_id, hit.role) == (result, "tool")

        fork = store.fork(answer)
        roles = [
            (n.role, n.meta.get("tool_calls"), n.meta.get("tool_call_id"))
            for n in store.active_path(fork)
        ]
        assert roles == [
            ("user", None, None),
            ("assistant", [CALL], None),
            ("tool", None, "call_1"),
            ("assistant", None, None),
        ]

        trash = Trash(store)
        trash.delete_branch(result)
        assert [n.role for n in store.active_path(cid)] == ["user", "assistant"]
        trash.restore()
        path = store.active_path(cid)
        assert [n.role for n in path] == ["user", "assistant", "tool", "assistant"]
        assert path[2].meta == RESULT_META


def test_json_export_import_and_markdown_show_calls_and_results():
    with ConversationStore(":memory:") as store:
        cid, _ = round_trip(store)
        for scope in ("path", "tree"):
            text = export_conversation(store, cid, "json", scope)
            new = store.import_conversation(parse_export(text))
            path = store.active_path(new)
            assert [n.role for n in path] == ["user", "assistant", "tool", "assistant"]
            assert path[1].meta["tool_calls"] == [CALL] and path[2].meta == RESULT_META
        md = export_conversation(store, cid, "md", "path")
        assert '→ calls `echo` with `{"text": "hi"}`' in md
        assert "## Tool · kit.echo\n\n```\necho: okapi\n```" in md
        tree = export_conversation(store, cid, "md", "tree")
        assert "**Tool**: (kit.echo)" in tree
