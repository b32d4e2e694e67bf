"""Import a conversation from its JSON export (core/chat/importer.py and
``ConversationStore.import_conversation``): export -> import gives an equal conversation,
and a malformed file is an error that stores nothing."""

from __future__ import annotations

import json

import pytest
from tierchat.core.chat.importer import ImportFormatError, parse_export, read_export
from tierchat.core.chat.store import ConversationStore
from tierchat.tui.export import export_conversation


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@pytest.fixture
def store():
    s = ConversationStore(":memory:", clock=Clock())
    yield s
    s.close()


def branched(store) -> int:
    """system, u0 -> (a0, a0'), edited u0' -> a; u1 under a0'; a0' selected, u0 selected."""
    cid = store.create_conversation("branches", system="Be brief.")
    root = store.active_path(cid)[0].id
    u0 = store.add_node(cid, root, "user", "In HTML, what does <br> do?\ncompute 2*3*4")
    store.add_node(cid, u0.id, "assistant", "a line break", token_ids=[5, 6, 4], meta={"m": 1})
    a0b = store.add_node(cid, u0.id, "assistant", "```html\n<br>\n```", token_ids=[])
    store.add_node(cid, a0b.id, "user", "and 24?")
    e = store.add_node(cid, root, "user", "edited question")
    store.add_node(cid, e.id, "assistant", "edited answer")
    store.select_child(root, u0.id)
    store.set_conversation_settings(cid, {"temperature": 0.7, "system": "Be brief."})
    return cid


def without_ids(doc):
    """An export with the store's ids dropped (new rows get new ids)."""
    doc = dict(doc)
    doc.pop("id")

    def clean(node):
        node = {k: v for k, v in node.items() if k not in ("id", "parent_id")}
        if "children" in node:
            node["children"] = [clean(c) for c in node["children"]]
        return node

    for key in ("roots", "messages"):
        if key in doc:
            doc[key] = [clean(n) for n in doc[key]]
    return doc


@pytest.mark.parametrize("scope", ["tree", "path"])
def test_export_then_import_gives_an_equal_conversation(store, scope):
    cid = branched(store)
    saved = store.conversation_settings(cid)
    text = export_conversation(store, cid, "json", scope, saved)
    new = store.import_conversation(parse_export(text))
    assert new != cid
    again = export_conversation(store, new, "json", scope, store.conversation_settings(new))
    assert without_ids(json.loads(again)) == without_ids(json.loads(text))
    old_path = [(n.role, n.content, n.token_ids, n.meta) for n in store.active_path(cid)]
    new_path = [(n.role, n.content, n.token_ids, n.meta) for n in store.active_path(new)]
    assert new_path == old_path
    assert store.get_conversation(new).updated_at == store.get_conversation(cid).updated_at
    assert store.search("24", conversation_id=new)  # imported messages are indexed


def test_read_export_from_a_file(store, tmp_path):
    cid = branched(store)
    path = tmp_path / "x.json"
    path.write_text(export_conversation(store, cid, "json", "tree"))
    conv = read_export(path)
    assert conv.title == "branches" and conv.count() == 7


BAD = {
    "not json": "{",
    "another format": json.dumps({"format": "other", "version": 1, "messages": []}),
    "newer version": json.dumps({"format": "tierchat-conversation", "version": 2}),
    "no messages": json.dumps({"format": "tierchat-conversation", "version": 1}),
    "bad role": json.dumps(
        {
            "format": "tierchat-conversation",
            "version": 1,
            "messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}],
        }
    ),
    "bad content": json.dumps(
        {"format": "tierchat-conversation", "version": 1, "messages": [{"role": "user"}]}
    ),
    "bad token ids": json.dumps(
        {
            "format": "tierchat-conversation",
            "version": 1,
            "roots": [{"role": "user", "content": "x", "token_ids": [1, "2"]}],
        }
    ),
    "bad child": json.dumps(
        {
            "format": "tierchat-conversation",
            "version": 1,
            "roots": [{"role": "user", "content": "x", "children": [{"role": "user"}]}],
        }
    ),
    "two active siblings": json.dumps(
        {
            "format": "tierchat-conversation",
            "version": 1,
            "roots": [
                {"role": "user", "content": "a", "active": True},
                {"role": "user", "content": "b", "active": True},
            ],
        }
    ),
    "a list": "[]",
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_malformed_export_is_an_error_and_stores_nothing(store, tmp_path, name):
    cid = branched(store)
    before = (store.list_conversations(), store.active_path(cid))
    path = tmp_path / "bad.json"
    path.write_text(BAD[name])
    with pytest.raises(ImportFormatError) as err:
        store.import_conversation(read_export(path))
    assert str(path) in str(err.value)
    assert (store.list_conversations(), store.active_path(cid)) == before


def test_the_error_names_the_field():
    with pytest.raises(ImportFormatError, match=r"roots\[0\]\.children\[0\]\.content"):
        parse_export(BAD["bad child"])
    with pytest.raises(ImportFormatError, match=r"messages\[1\]\.role"):
        parse_export(BAD["bad role"])


def test_a_failure_inside_the_insert_rolls_back(store, monkeypatch):
    cid = branched(store)
    conv = parse_export(export_conversation(store, cid, "json", "tree"))
    before = store.list_conversations()
    count = store._conn.execute("SELECT count(*) FROM nodes").fetchone()[0]
    real = store.db.set_selected
    calls = []

    def failing(*args):
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError("disk went away")
        return real(*args)

    monkeypatch.setattr(store.db, "set_selected", failing)
    with pytest.raises(RuntimeError):
        store.import_conversation(conv)
    assert store.list_conversations() == before
    assert store._conn.execute("SELECT count(*) FROM nodes").fetchone()[0] == count


def test_unreadable_or_huge_files(tmp_path, monkeypatch):
    with pytest.raises(ImportFormatError, match="cannot read"):
        read_export(tmp_path / "missing.json")
    from tierchat.core.chat import importer

    big = tmp_path / "big.json"
    big.write_text("x" * 100)
    monkeypatch.setattr(importer, "MAX_BYTES", 10)
    with pytest.raises(ImportFormatError, match="limit"):
        read_export(big)


def test_a_deep_chain_imports_without_recursion(store):
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(3000)
    ]
    doc = {"format": "tierchat-conversation", "version": 1, "messages": messages}
    new = store.import_conversation(parse_export(json.dumps(doc)))
    path = store.active_path(new)
    assert len(path) == 3000 and path[-1].content == "m2999"
