"""Full-text search in the conversation store: the FTS5 index (a migration fills it from
the messages already stored), kept in step on insert, edit and delete, and the query
built from typed text (core/chat/search.py)."""

from __future__ import annotations

import sqlite3

import pytest
from tierchat.core.chat.search import fts_query, split_marks
from tierchat.core.chat.sqlite import MIGRATIONS
from tierchat.core.chat.store import ConversationError, ConversationStore


@pytest.fixture
def store():
    s = ConversationStore(":memory:")
    yield s
    s.close()


def chat(store, title, *texts):
    cid = store.create_conversation(title)
    parent = None
    nodes = []
    for i, text in enumerate(texts):
        node = store.add_node(cid, parent, "user" if i % 2 == 0 else "assistant", text)
        nodes.append(node)
        parent = node.id
    return cid, nodes


def ids(hits):
    return [h.node_id for h in hits]


def test_query_quotes_words_and_prefixes_the_last():
    assert fts_query("prefix cach") == '"prefix" "cach"*'
    assert fts_query('a "quoted" AND NOT (x)') == '"a" "quoted" "AND" "NOT" "x"*'
    assert fts_query("  ?! ") is None
    assert fts_query("naïve 東京") == '"naïve" "東京"*'


def test_split_marks():
    assert split_marks("a \x02cache\x03 b \x02hit\x03") == ("a cache b hit", ((2, 7), (10, 13)))


def test_search_across_conversations_and_in_one(store):
    c1, n1 = chat(store, "kv", "What is a prefix cache?", "It keeps the KV of a prefix.")
    c2, n2 = chat(store, "poems", "Write a poem about rain.", "Rain on the prefix of May.")
    hits = store.search("prefix")
    assert set(ids(hits)) == {n1[0].id, n1[1].id, n2[1].id}
    assert {h.title for h in hits} == {"kv", "poems"}
    assert ids(store.search("prefix", conversation_id=c2)) == [n2[1].id]
    hit = store.search("rain poem")[0]  # every word, in any order
    assert (hit.node_id, hit.conversation_id, hit.role) == (n2[0].id, c2, "user")
    assert hit.snippet == "Write a poem about rain." and len(hit.marks) == 2
    assert ids(store.search("cach")) == [n1[0].id]  # the last word is a prefix
    assert store.search("") == [] and store.search("zebra") == []
    with pytest.raises(ConversationError):
        store.search("x", conversation_id=999)


def test_syntax_in_typed_text_is_plain_text(store):
    _, nodes = chat(store, "t", 'In HTML, what does <br> do? compute 2*3*4 "NEAR" AND')
    for typed in ('"', "AND", "NEAR(", "2*3*4", "<br>", "do?", "col:umn"):
        hits = store.search(typed)
        assert all(h.node_id == nodes[0].id for h in hits), typed


def test_index_follows_insert_edit_and_delete(store):
    cid, nodes = chat(store, "t", "alpha question", "beta answer", "gamma follow-up")
    assert ids(store.search("gamma")) == [nodes[2].id]
    store._conn.execute("UPDATE nodes SET content = 'delta' WHERE id = ?", (nodes[2].id,))
    assert store.search("gamma") == [] and ids(store.search("delta")) == [nodes[2].id]
    store.delete_subtree(nodes[1].id)  # the cascade removes node 2 as well
    assert store.search("beta") == [] and store.search("delta") == []
    assert ids(store.search("alpha")) == [nodes[0].id]
    store.delete_message(nodes[0].id)
    assert store.search("alpha") == []
    cid2, more = chat(store, "u", "epsilon")
    store.delete_conversation(cid2)
    assert store.search("epsilon") == []
    count = store._conn.execute("SELECT count(*) FROM nodes_fts").fetchone()[0]
    assert count == store._conn.execute("SELECT count(*) FROM nodes").fetchone()[0]


def test_migration_indexes_messages_stored_before_it(tmp_path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(f"BEGIN; {MIGRATIONS[0]}; {MIGRATIONS[1]}; PRAGMA user_version = 2; COMMIT;")
    conn.execute(
        "INSERT INTO conversations (id, title, created_at, updated_at) VALUES (1, 'old', 0, 0)"
    )
    conn.execute(
        "INSERT INTO nodes (id, conversation_id, role, content, created_at) "
        "VALUES (7, 1, 'user', 'an old message about tokenizers', 0)"
    )
    conn.commit()
    conn.close()
    with ConversationStore(path) as s:
        assert s.schema_version == len(MIGRATIONS)
        hits = s.search("tokenizer")
        assert ids(hits) == [7] and hits[0].title == "old"
