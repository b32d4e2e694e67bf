"""ConversationStore: every tree operation, errors, reopening the file, schema versions."""

from __future__ import annotations

import sqlite3
import threading

import pytest
from tierchat.core.chat.sqlite import SCHEMA_VERSION, StoreError
from tierchat.core.chat.store import ConversationError, ConversationStore


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "data" / "conversations.sqlite", clock=Clock())
    yield s
    s.close()


def chat(store, system="Be brief."):
    """A conversation: system, u0 -> a0, u1 -> a1 (all selected)."""
    cid = store.create_conversation("chat", system=system)
    root = store.active_path(cid)[-1].id if system else None
    u0 = store.add_node(cid, root, "user", "hi")
    a0 = store.add_node(cid, u0.id, "assistant", "hello", token_ids=[5, 6, 4], meta={"x": 1})
    u1 = store.add_node(cid, a0.id, "user", "how are you?")
    a1 = store.add_node(cid, u1.id, "assistant", "fine")
    return cid, u0, a0, u1, a1


def contents(nodes):
    return [n.content for n in nodes]


def test_create_and_list(store):
    a = store.create_conversation("first")
    b = store.create_conversation(system="sys")
    infos = store.list_conversations()
    assert [i.id for i in infos] == [b, a]  # most recently updated first
    assert infos[1].title == "first" and infos[0].title is None
    assert contents(store.active_path(a)) == []
    path = store.active_path(b)
    assert [(n.role, n.content, n.parent_id) for n in path] == [("system", "sys", None)]
    assert store.get_conversation(a).created_at < store.get_conversation(b).created_at


def test_add_node_and_active_path(store):
    cid, u0, a0, _u1, _a1 = chat(store)
    path = store.active_path(cid)
    assert contents(path) == ["Be brief.", "hi", "hello", "how are you?", "fine"]
    assert path[2].token_ids == (5, 6, 4) and path[2].meta == {"x": 1}
    assert path[1].token_ids is None and path[1].meta == {}
    assert store.get_node(a0.id) == a0
    assert contents(store.user_turns(cid)) == ["hi", "how are you?"]
    assert store.children(u0.id) == [a0]
    assert store.get_conversation(cid).updated_at > store.get_conversation(cid).created_at


def test_regenerate_swipe_and_edit(store):
    cid, u0, _a0, u1, a1 = chat(store)
    b1 = store.add_node(cid, u1.id, "assistant", "great")  # regenerate selects the new one
    assert contents(store.replies(u1.id)) == ["fine", "great"]
    assert contents(store.active_path(cid))[-1] == "great"
    store.select_child(u1.id, a1.id)  # swipe back
    assert contents(store.active_path(cid))[-1] == "fine"
    assert store.selected_child(u1.id) == a1
    # edit turn 0: a sibling user node; the path follows it and ends there
    e0 = store.add_node(cid, u0.parent_id, "user", "hey")
    assert contents(store.active_path(cid)) == ["Be brief.", "hey"]
    assert contents(store.siblings(e0.id)) == ["hi", "hey"]
    store.select_child(u0.parent_id, u0.id)  # the old branch is intact, selections kept
    assert contents(store.active_path(cid)) == ["Be brief.", "hi", "hello", "how are you?", "fine"]
    assert b1.id in [n.id for n in store.replies(u1.id)]


def test_roots_without_system(store):
    cid, u0, _a0, *_ = chat(store, system=None)
    assert store.active_path(cid)[0] == u0
    other = store.add_node(cid, None, "user", "edited first")
    assert contents(store.active_path(cid)) == ["edited first"]
    assert contents(store.roots(cid)) == ["hi", "edited first"]
    store.select_child(None, u0.id)
    assert store.active_path(cid)[0] == u0
    assert store.siblings(other.id) == store.roots(cid)


def test_add_node_unselected(store):
    cid, _u0, _a0, u1, a1 = chat(store)
    store.add_node(cid, u1.id, "assistant", "draft", select=False)
    assert store.active_path(cid)[-1] == a1


def test_delete_subtree_reselects(store):
    cid, u0, a0, u1, a1 = chat(store)
    b1 = store.add_node(cid, u1.id, "assistant", "great")
    store.add_node(cid, b1.id, "user", "and then?")
    store.delete_subtree(b1.id)
    assert contents(store.replies(u1.id)) == ["fine"]
    assert store.active_path(cid)[-1] == a1
    with pytest.raises(ConversationError):
        store.get_node(b1.id)
    store.delete_subtree(u0.id)  # the whole branch under the system prompt goes
    assert contents(store.active_path(cid)) == ["Be brief."]
    for n in (u0, a0, u1, a1):
        with pytest.raises(ConversationError):
            store.get_node(n.id)


def test_delete_root_and_conversation(store):
    cid, u0, *_ = chat(store, system=None)
    store.delete_subtree(u0.id)
    assert store.active_path(cid) == []
    store.delete_conversation(cid)
    assert store.list_conversations() == []
    with pytest.raises(ConversationError, match=f"no conversation with id {cid}"):
        store.active_path(cid)


def test_rename(store):
    cid = store.create_conversation("old")
    store.rename(cid, "new")
    assert store.get_conversation(cid).title == "new"


def test_fork(store):
    cid, u0, a0, u1, a1 = chat(store)
    store.add_node(cid, u1.id, "assistant", "other reply", select=False)
    new = store.fork(a0.id)
    assert new != cid
    assert store.get_conversation(new).title == "chat (fork)"
    path = store.active_path(new)
    assert contents(path) == ["Be brief.", "hi", "hello"]
    assert path[-1].token_ids == (5, 6, 4) and path[-1].meta == {"x": 1}
    assert all(n.conversation_id == new for n in path)
    assert {n.id for n in path}.isdisjoint({u0.id, a0.id})
    assert len(store.active_path(cid)) == 5  # the original is untouched
    assert store.path_to(a1.id)[-1] == a1


def test_unknown_ids(store):
    cid, u0, _a0, u1, a1 = chat(store)
    other = store.create_conversation()
    cases = [
        lambda: store.get_node(999),
        lambda: store.children(999),
        lambda: store.replies(999),
        lambda: store.delete_subtree(999),
        lambda: store.fork(999),
        lambda: store.select_child(u1.id, 999),
        lambda: store.select_child(u0.id, a1.id),  # not its child
        lambda: store.select_child(None, a1.id),  # not a root
        lambda: store.add_node(999, None, "user", "x"),
        lambda: store.add_node(cid, 999, "user", "x"),
        lambda: store.add_node(other, a1.id, "user", "x"),  # parent in another conversation
        lambda: store.rename(999, "x"),
        lambda: store.delete_conversation(999),
        lambda: store.get_conversation(999),
        lambda: store.user_turns(999),
    ]
    for case in cases:
        with pytest.raises(ConversationError) as e:
            case()
        assert isinstance(e.value, KeyError)
        assert not str(e.value).startswith("'")  # a readable message, not a repr
    with pytest.raises(ValueError, match="role"):
        store.add_node(cid, None, "robot", "x")


def test_failed_operation_leaves_no_partial_write(store):
    cid, *_ = chat(store)
    before = store.active_path(cid)
    with pytest.raises(ConversationError):
        store.add_node(cid, 999, "user", "x")
    assert store.active_path(cid) == before


def test_reopen_file(tmp_path):
    path = tmp_path / "c.sqlite"
    with ConversationStore(path) as s:
        cid, _u0, _a0, u1, a1 = chat(s)
        s.add_node(cid, u1.id, "assistant", "second", select=False)
        s.select_child(u1.id, a1.id)
        expected = s.active_path(cid)
    with ConversationStore(path) as s:
        assert s.schema_version == SCHEMA_VERSION
        assert s.active_path(cid) == expected
        assert contents(s.replies(u1.id)) == ["fine", "second"]
        assert s.list_conversations()[0].title == "chat"
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "c.sqlite"
    ConversationStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this tierchat supports"):
        ConversationStore(path)


def test_not_a_database(tmp_path):
    path = tmp_path / "c.sqlite"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError, match="not a tierchat conversation store"):
        ConversationStore(path)


def test_threads_share_the_store(store):
    cid = store.create_conversation()
    root = store.add_node(cid, None, "system", "s")
    errors = []

    def worker(k):
        try:
            for i in range(20):
                store.add_node(cid, root.id, "user", f"{k}-{i}", select=False)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(store.children(root.id)) == 80


def test_active_path_entries_match_the_walk_with_sibling_places(store):
    cid, u0, a0, u1, a1 = chat(store)
    store.add_node(cid, u1.id, "assistant", "second")  # a1' selected
    store.select_child(u1.id, a1.id)
    e0 = store.add_node(cid, a0.id, "user", "edited")  # u1' selected: a new branch
    store.add_node(cid, e0.id, "assistant", "reply to edit")
    entries = store.active_path_entries(cid)
    assert [e.node for e in entries] == store.active_path(cid)
    assert [(e.node.role, e.index, e.count) for e in entries] == [
        ("system", 0, 1),
        ("user", 0, 1),
        ("assistant", 0, 1),
        ("user", 1, 2),
        ("assistant", 0, 1),
    ]
    store.select_child(a0.id, u1.id)  # back to the first branch: its reply 1 of 2
    entries = store.active_path_entries(cid)
    assert [e.node for e in entries] == store.active_path(cid)
    assert [(e.index, e.count) for e in entries[-2:]] == [(0, 2), (0, 2)]
    assert entries[-1].node.meta == {} and entries[2].node.meta == {"x": 1}
    assert entries[2].node.token_ids == (5, 6, 4)


def test_active_path_entries_of_an_empty_and_an_unknown_conversation(store):
    cid = store.create_conversation("empty")
    assert store.active_path_entries(cid) == []
    with pytest.raises(ConversationError):
        store.active_path_entries(cid + 99)


def test_active_path_entries_fall_back_to_the_newest_child(store):
    cid, u0, a0, _u1, _a1 = chat(store, system=None)
    store.delete_subtree(a0.id)  # u0's selection points at a deleted node
    other = store.add_node(cid, u0.id, "assistant", "newer", select=False)
    assert [e.node for e in store.active_path_entries(cid)] == store.active_path(cid)
    assert store.active_path_entries(cid)[-1].node.id == other.id


def test_conversation_settings_round_trip_and_migrate(tmp_path):
    path = tmp_path / "c.sqlite"
    conn = sqlite3.connect(path)  # a version-1 file, before settings existed
    from tierchat.core.chat.sqlite import MIGRATIONS

    conn.executescript(f"BEGIN; {MIGRATIONS[0]}; PRAGMA user_version = 1; COMMIT;")
    conn.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('x', 1, 1)")
    conn.commit()
    conn.close()
    with ConversationStore(path) as s:
        assert s.schema_version == SCHEMA_VERSION
        (info,) = s.list_conversations()
        assert s.conversation_settings(info.id) == {}
        s.set_conversation_settings(info.id, {"temperature": 0.7, "system": "Be brief."})
    with ConversationStore(path) as s:
        assert s.conversation_settings(info.id) == {"temperature": 0.7, "system": "Be brief."}
        with pytest.raises(ConversationError):
            s.conversation_settings(info.id + 1)
