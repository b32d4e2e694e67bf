"""Undo for deletions (core/chat/trash.py): a conversation, a branch and one message come
back as they were (contents, generated ids, meta, selected branches); a continued reply
goes back to its cut version; the history is kept in the store, so it survives a restart,
bounded to the newest twenty."""

from __future__ import annotations

import pytest
from tierchat.core.chat.store import ConversationError, ConversationStore
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


def test_the_undo_history_survives_a_restart_in_order(tmp_path):
    path = tmp_path / "c.sqlite"
    store = ConversationStore(path)
    cid, (root, q1, a1, a1b, q2, a2) = chat(store)
    other = store.create_conversation("Rome")
    before = contents(store, cid)
    Trash(store).delete_branch(a1.id)
    Trash(store).delete_conversation(other)
    store.close()

    store = ConversationStore(path)  # a new process: the history is read from the file
    try:
        trash = Trash(store)
        assert len(trash) == 2
        item, new, _ = trash.restore()  # newest first: the conversation
        assert item.kind == "conversation" and store.get_conversation(new).title == "Rome"
        item, _, top = trash.restore()
        assert item.kind == "branch" and contents(store, cid) == before
        assert store.get_node(top).token_ids == (5, 6) and store.get_node(top).meta == {
            "model": "m"
        }
        assert len(trash) == 0
    finally:
        store.close()


def test_the_history_keeps_the_newest_twenty_and_a_failed_undo_keeps_its_item(store):
    cid = store.create_conversation("many")
    user = store.add_node(cid, None, "user", "q")
    replies = [store.add_node(cid, user.id, "assistant", f"a{i}") for i in range(23)]
    trash = Trash(store)
    for r in replies:
        trash.delete_branch(r.id)
    assert len(trash) == 20
    store.delete_conversation(cid)  # where the items hung is gone
    with pytest.raises(ConversationError):
        trash.restore()
    assert len(trash) == 20  # still there for a later try


def test_a_continued_reply_goes_back_to_its_cut_version(store):
    cid, (root, q1, a1, a1b, q2, a2) = chat(store)
    trash = Trash(store)
    grown = trash.replace_reply(a2, "a2 and more", (8, 9, 10), {"model": "m", "continued": 1})
    assert store.get_node(a2.id) == grown and grown.content == "a2 and more"
    assert [r.id for r in store.replies(q2.id)] == [a2.id]  # one reply, grown in place
    item, _, node = trash.restore()
    assert item.kind == "reply" and node == a2.id
    back = store.get_node(a2.id)
    assert (back.content, back.token_ids, back.meta) == ("a2", (8, 9), {})
