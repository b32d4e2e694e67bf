"""Undo for deletions (core/chat/trash.py): a conversation, a branch and one message come
back as they were (contents, generated ids, meta, selected branches)."""

from __future__ import annotations

import pytest
from tierchat.core.chat.store import ConversationStore
from tierchat.core.chat.trash import Trash


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "c.sqlite")
    yield s
    s.close()


def chat(store) -> tuple[int, list]:
    cid = store.create_conversation("Paris trip", system="Be brief.")
    root = store.roots(cid)[0]
    q1 = store.add_node(cid, root.id, "user", "q1")
    a1 = store.add_node(cid, q1.id, "assistant", "a1", token_ids=[5, 6], meta={"model": "m"})
    a1b = store.add_node(cid, q1.id, "assistant", "a1b", token_ids=[7])
    store.select_child(q1.id, a1.id)
    q2 = store.add_node(cid, a1.id, "user", "q2")
    a2 = store.add_node(cid, q2.id, "assistant", "a2", token_ids=[8, 9])
    store.set_conversation_settings(cid, {"temperature": 0.5})
    return cid, [root, q1, a1, a1b, q2, a2]


def contents(store, cid) -> list[str]:
    return [n.content for n in store.active_path(cid)]


def test_a_deleted_conversation_comes_back_whole(store):
    cid, _ = chat(store)
    before = contents(store, cid)
    trash = Trash(store)
    trash.delete_conversation(cid)
    assert store.list_conversations() == []
    item, new, node = trash.restore()
    assert item.kind == "conversation" and item.label == "“Paris trip”" and node is None
    assert contents(store, new) == before
    assert store.conversation_settings(new) == {"temperature": 0.5}
    assert [n.token_ids for n in store.active_path(new)][-1] == (8, 9)
    assert len(trash) == 0
    with pytest.raises(IndexError):
        trash.restore()


def test_a_deleted_branch_comes_back_under_its_parent(store):
    cid, (root, q1, a1, a1b, q2, a2) = chat(store)
    before = contents(store, cid)
    trash = Trash(store)
    trash.delete_branch(a1.id)
    assert contents(store, cid) == ["Be brief.", "q1", "a1b"]
    item, _, top = trash.restore()
    assert item.label == "3 messages"
    assert contents(store, cid) == before
    path = store.active_path(cid)
    assert path[2].id == top and path[2].token_ids == (5, 6) and path[2].meta == {"model": "m"}
    assert [n.content for n in store.replies(q1.id)] == ["a1b", "a1"]


def test_a_deleted_message_comes_back_with_what_followed_it_below(store):
    cid, (root, q1, a1, a1b, q2, a2) = chat(store)
    before = contents(store, cid)
    trash = Trash(store)
    moved = trash.delete_message(a1.id)
    assert moved.id == q2.id
    assert contents(store, cid) == ["Be brief.", "q1", "q2", "a2"]
    trash.restore()
    assert contents(store, cid) == before
    assert store.get_node(q2.id).parent_id == store.active_path(cid)[2].id
