"""Undo for deletions and continued replies: what a delete removed or a continue
replaced, kept so that it can be put back (docs/DESIGN.md §12).

A :class:`Trash` holds the last :data:`TRASH_ITEMS` deletions of a store (a conversation,
a branch, or one message) and replies grown in place by a continue, each as a snapshot
taken before the change: the messages with their content, generated token ids, meta and
times, and which branch was selected. The snapshots live in the store's ``trash`` table
(:class:`TrashRows`, written in the change's own transaction), so an undo works
after a restart, and in any process that opens the store.
:meth:`Trash.restore` puts the newest one back: a conversation is imported again (a new
id, as :meth:`~.store.ConversationStore.import_conversation` does), a branch is added
again under its parent, a message is added again under its parent and the message that
had moved up into its place moves back under it; a continued reply gets its cut content,
ids and meta back (the same id). Restored messages get new ids; their
generated token ids come back with them, so the prompts that splice them (and the cache
entries keyed by those ids) are the ones they were.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

from .importer import FORMAT, ImportedConversation, ImportedNode, parse_export
from .sqlite import Database
from .store import ConversationStore, Node

TRASH_ITEMS = 20
"""Changes kept for undo per store (across its conversations), newest first out."""

DeletedKind = Literal["conversation", "branch", "message", "reply"]


@dataclass(frozen=True)
class Deleted:
    """One deletion, or a reply's version before a continue (``kind`` "reply": ``root``
    holds it, ``parent_id`` is its own id). ``parent_id``: where a branch or message hung
    (None: a root); ``moved_id``: the message that moved up into a deleted message's
    place (None: none); ``label``: what the UI calls it ("“Paris trip”", "3 messages")."""

    kind: DeletedKind
    conversation_id: int
    parent_id: int | None
    root: ImportedNode | None
    conversation: ImportedConversation | None
    moved_id: int | None
    label: str

    def to_json(self) -> str:
        """The snapshot as JSON: the tree in the export's format (core/chat/importer.py)."""
        d: dict[str, Any] = {"parent_id": self.parent_id, "moved_id": self.moved_id}
        if self.root is not None:
            d["root"] = _doc(None, 0.0, 0.0, {}, (self.root,))
        if self.conversation is not None:
            c = self.conversation
            d["conversation"] = _doc(c.title, c.created_at, c.updated_at, c.settings, c.roots)
        return json.dumps(d)

    @classmethod
    def from_row(cls, kind: str, conversation_id: int, label: str, item: str) -> Deleted:
        """Read back :meth:`to_json` (raises ``ImportFormatError``/``ValueError`` for a
        row that is not one)."""
        d = json.loads(item)
        root = parse_export(json.dumps(d["root"])).roots[0] if "root" in d else None
        conv = parse_export(json.dumps(d["conversation"])) if "conversation" in d else None
        return cls(kind, conversation_id, d["parent_id"], root, conv, d["moved_id"], label)  # type: ignore[arg-type]


def _doc(title, created_at, updated_at, settings, roots) -> dict[str, Any]:
    """A tree export (format version 1) of ``roots``."""
    return {
        "format": FORMAT,
        "version": 1,
        "title": title,
        "created_at": created_at,
        "updated_at": updated_at,
        "settings": settings,
        "roots": [asdict(r) for r in roots],
    }


def snapshot_node(store: ConversationStore, node: Node, active: bool = True) -> ImportedNode:
    """``node`` and everything under it, with the selected branch marked ``active``."""
    chosen = store.selected_child(node.id)
    kids = tuple(
        snapshot_node(store, child, chosen is not None and child.id == chosen.id)
        for child in store.children(node.id)
    )
    return ImportedNode(
        node.role, node.content, node.token_ids, node.created_at, dict(node.meta or {}), active,
        kids,
    )  # fmt: skip


def snapshot_conversation(store: ConversationStore, conversation_id: int) -> ImportedConversation:
    """The whole conversation as :meth:`~.store.ConversationStore.import_conversation`
    stores it. Raises ``ConversationError`` for an unknown id."""
    info = store.get_conversation(conversation_id)
    chosen = store.selected_child(None, conversation_id)
    roots = tuple(
        snapshot_node(store, r, chosen is not None and r.id == chosen.id)
        for r in store.roots(conversation_id)
    )
    settings = store.conversation_settings(conversation_id)
    return ImportedConversation(info.title, info.created_at, info.updated_at, settings, roots)


class TrashRows:
    """The ``trash`` table of a store's database ``db`` (a :class:`Trash` keeps its undo
    history there): rows of ``(id, kind, conversation_id, label, item)``, ``item`` a JSON
    snapshot, newest last; at most ``keep`` rows, the oldest dropped."""

    def __init__(self, db: Database, keep: int) -> None:
        self.db, self.keep = db, keep

    def __len__(self) -> int:
        with self.db.lock:
            return self.db.one("SELECT COUNT(*) FROM trash")[0]

    def push(self, kind: str, conversation_id: int, label: str, item: str) -> None:
        """Add a row (joining the caller's :meth:`~.store.ConversationStore.transaction`)."""
        with self.db.transaction():
            self.db.conn.execute(
                "INSERT INTO trash (kind, conversation_id, label, created_at, item) "
                "VALUES (?, ?, ?, ?, ?)",
                (kind, conversation_id, label, self.db.clock(), item),
            )
            self.db.conn.execute(
                "DELETE FROM trash WHERE id NOT IN (SELECT id FROM trash ORDER BY id DESC LIMIT ?)",
                (self.keep,),
            )

    def newest(self) -> tuple[int, str, int, str, str] | None:
        """The newest row, or None when the table is empty."""
        with self.db.lock:
            return self.db.one(
                "SELECT id, kind, conversation_id, label, item FROM trash ORDER BY id DESC LIMIT 1"
            )

    def remove(self, row_id: int) -> None:
        with self.db.transaction():
            self.db.conn.execute("DELETE FROM trash WHERE id = ?", (row_id,))


class Trash:
    """The last changes of a store, newest first out. Each ``delete_*`` snapshots,
    deletes through the store and keeps the snapshot in one transaction; errors of the
    store propagate (nothing is kept, nothing deleted)."""

    def __init__(self, store: ConversationStore, size: int = TRASH_ITEMS) -> None:
        self.store = store
        self.rows = TrashRows(store.db, size)

    def __len__(self) -> int:
        return len(self.rows)

    def _keep(self, item: Deleted) -> None:
        self.rows.push(item.kind, item.conversation_id, item.label, item.to_json())

    def delete_conversation(self, conversation_id: int) -> None:
        with self.store.transaction():
            snap = snapshot_conversation(self.store, conversation_id)
            self.store.delete_conversation(conversation_id)
            label = f"“{snap.title}”" if snap.title else f"conversation {conversation_id}"
            self._keep(Deleted("conversation", conversation_id, None, None, snap, None, label))

    def delete_branch(self, node_id: int) -> None:
        with self.store.transaction():
            node = self.store.get_node(node_id)
            snap = snapshot_node(self.store, node)
            n = self.store.subtree_size(node_id)
            self.store.delete_subtree(node_id)
            label = f"{n} message{'s' if n != 1 else ''}"
            self._keep(
                Deleted("branch", node.conversation_id, node.parent_id, snap, None, None, label)
            )

    def delete_message(self, node_id: int) -> Node | None:
        """As :meth:`~.store.ConversationStore.delete_message`; returns the moved child."""
        with self.store.transaction():
            node = self.store.get_node(node_id)
            moved = self.store.delete_message(node_id)
            leaf = ImportedNode(
                node.role, node.content, node.token_ids, node.created_at, dict(node.meta or {}), True
            )  # fmt: skip
            moved_id = moved.id if moved is not None else None
            label = f"the {node.role} message"
            self._keep(
                Deleted(
                    "message", node.conversation_id, node.parent_id, leaf, None, moved_id, label
                )
            )
        return moved

    def replace_reply(self, reply: Node, content: str, token_ids, meta: dict[str, Any]) -> Node:
        """Grow ``reply`` in place to ``content``/``token_ids``/``meta`` (a continue,
        :meth:`~.store.ConversationStore.replace_reply`), keeping the cut version for
        undo, in one transaction. Returns the node as stored."""
        with self.store.transaction():
            old = ImportedNode(
                reply.role, reply.content, reply.token_ids, reply.created_at, dict(reply.meta or {}), True
            )  # fmt: skip
            new = self.store.replace_reply(reply.id, content, token_ids, meta)
            self._keep(
                Deleted("reply", reply.conversation_id, reply.id, old, None, None, "the continue")
            )
        return new

    def restore(self) -> tuple[Deleted, int, int | None]:
        """Undo the newest change: ``(what, conversation id, restored node id)`` (node None
        for a conversation). Raises ``IndexError`` when the trash is empty and
        ``ConversationError`` when the place it hung from is gone too (it stays kept)."""
        store = self.store
        with store.transaction():
            row = self.rows.newest()
            if row is None:
                raise IndexError("nothing to undo")
            row_id, kind, cid, label, data = row
            item = Deleted.from_row(kind, cid, label, data)
            if item.kind == "conversation":
                restored = item, store.import_conversation(item.conversation), None
            elif item.kind == "reply":
                r = item.root
                store.replace_reply(item.parent_id, r.content, r.token_ids, r.meta)
                restored = item, cid, item.parent_id
            else:
                top = self._add(cid, item.parent_id, item.root)
                if item.kind == "message" and item.moved_id is not None:
                    store.move_node(item.moved_id, top)
                restored = item, cid, top
            self.rows.remove(row_id)
        return restored

    def _add(self, cid: int, parent: int | None, node: ImportedNode) -> int:
        """Add ``node`` and its subtree under ``parent``, selecting it there and the
        branches it had selected below."""
        added = self.store.add_node(
            cid, parent, node.role, node.content, token_ids=node.token_ids, meta=node.meta
        )
        for child in node.children:
            self._add_below(cid, added.id, child)
        return added.id

    def _add_below(self, cid: int, parent: int, node: ImportedNode) -> None:
        added = self.store.add_node(
            cid,
            parent,
            node.role,
            node.content,
            token_ids=node.token_ids,
            meta=node.meta,
            select=node.active,
        )
        for child in node.children:
            self._add_below(cid, added.id, child)
