"""Conversation trees in SQLite (docs/DESIGN.md §12). Pure Python: stdlib ``sqlite3`` only.

A conversation is a tree of nodes (system / user / assistant messages, tool results). Every parent
remembers one selected child, and the conversation remembers its selected root, so the
**active path** -- what the model sees -- is the walk from the selected root through
selected children. Regenerate adds an assistant sibling, edit adds a user sibling, swipe
changes a selection; nothing is ever overwritten.

The file uses WAL and carries its schema version in ``PRAGMA user_version``; opening it
applies the missing steps of the migrations. One connection is shared by every thread
that uses the store, serialized by a lock: the store's :class:`~.sqlite.Database`, which
the modules that read and write its other parts share (full-text search in
``core/chat/search.py``, imports in ``core/chat/importer.py``, the undo rows in
``core/chat/trash.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from .importer import ImportedConversation, insert_conversation
from .search import SearchHit, search_nodes
from .sqlite import (
    BUSY_TIMEOUT_S,
    SIBLING_COUNT_SQL,
    SIBLING_INDEX_SQL,
    ConversationError,
    Database,
)

__all__ = [
    "ROLES",
    "ConversationError",
    "ConversationInfo",
    "ConversationStore",
    "Node",
    "PathEntry",
]

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Node:
    """One message. ``token_ids`` are the ids an assistant reply was generated as (with
    its EOS when one was generated), None when not known. ``created_at`` is epoch seconds."""

    id: int
    conversation_id: int
    parent_id: int | None
    role: str
    content: str
    token_ids: tuple[int, ...] | None
    created_at: float
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class ConversationInfo:
    id: int
    title: str | None
    created_at: float
    updated_at: float


_NODE_COLUMNS = "id, conversation_id, parent_id, role, content, token_ids, created_at, meta"


@dataclass(frozen=True)
class PathEntry:
    """One node of the active path with its place among its siblings of the same role:
    ``index`` (0-based, creation order) of ``count``."""

    node: Node
    index: int
    count: int


def _node(row: tuple) -> Node:
    nid, cid, parent, role, content, token_ids, created_at, meta = row
    ids = tuple(json.loads(token_ids)) if token_ids is not None else None
    return Node(nid, cid, parent, role, content, ids, created_at, json.loads(meta))


class ConversationStore:
    """Conversation trees in one SQLite file (``":memory:"`` for a throwaway store).

    Raises :class:`StoreError` when the file is not a SQLite database or was written by a
    newer tierchat (a schema version above :data:`SCHEMA_VERSION`). A file locked by
    another process is waited for up to ``busy_timeout_s`` seconds per operation (SQLite's
    busy handler retries meanwhile), then the operation raises a "busy" ``StoreError`` and
    the store stays usable for the next one (docs/DESIGN.md §12).
    """

    def __init__(
        self,
        path: str | Path,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
    ) -> None:
        self.path = str(path)
        self.clock = clock
        self.busy_timeout_s = busy_timeout_s
        self.db = Database(self.path, clock, busy_timeout_s)
        """The open file, shared with the modules that read and write its tables."""
        self._conn, self._lock = self.db.conn, self.db.lock

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def schema_version(self) -> int:
        with self._lock:
            return self._conn.execute("PRAGMA user_version").fetchone()[0]

    # ------------------------------------------------------------------ helpers

    def _tx(self) -> AbstractContextManager[None]:
        return self.db.transaction()

    def transaction(self) -> AbstractContextManager[None]:
        """One transaction around several calls (each joins it): all of them or none."""
        return self._tx()

    def _one(self, sql: str, args: Iterable = ()) -> tuple | None:
        return self.db.one(sql, args)

    def _check_conversation(self, conversation_id: int) -> None:
        self.db.check_conversation(conversation_id)

    def _touch(self, conversation_id: int) -> None:
        self.db.touch(conversation_id)

    # ------------------------------------------------------------------ conversations

    def create_conversation(self, title: str | None = None, system: str | None = None) -> int:
        """A new conversation; ``system`` (when given) becomes its root node. Returns its id."""
        now = self.clock()
        with self._tx():
            cur = self._conn.execute(
                "INSERT INTO conversations (title, created_at, updated_at) VALUES (?, ?, ?)",
                (title, now, now),
            )
            cid = cur.lastrowid
            if system is not None:
                self.add_node(cid, None, "system", system)
        return cid

    def get_conversation(self, conversation_id: int) -> ConversationInfo:
        """Raises :class:`ConversationError` for an unknown id."""
        with self._lock:
            row = self._one(
                "SELECT id, title, created_at, updated_at FROM conversations WHERE id = ?",
                (conversation_id,),
            )
        if row is None:
            raise ConversationError(f"no conversation with id {conversation_id}")
        return ConversationInfo(*row)

    def list_conversations(self) -> list[ConversationInfo]:
        """Every conversation, most recently updated first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, title, created_at, updated_at FROM conversations "
                "ORDER BY updated_at DESC, id DESC"
            ).fetchall()
        return [ConversationInfo(*r) for r in rows]

    def rename(self, conversation_id: int, title: str | None) -> None:
        """Set the title. Raises :class:`ConversationError` for an unknown id."""
        with self._tx():
            self._check_conversation(conversation_id)
            self._conn.execute(
                "UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id)
            )
            self._touch(conversation_id)

    def delete_conversation(self, conversation_id: int) -> None:
        """Delete a conversation and all its nodes. Raises :class:`ConversationError`."""
        with self._tx():
            self._check_conversation(conversation_id)
            self._conn.execute("DELETE FROM nodes WHERE conversation_id = ?", (conversation_id,))
            self._conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # ------------------------------------------------------------------ nodes

    def add_node(
        self,
        conversation_id: int,
        parent_id: int | None,
        role: str,
        content: str,
        *,
        token_ids: Iterable[int] | None = None,
        meta: dict[str, Any] | None = None,
        select: bool = True,
    ) -> Node:
        """Append a node under ``parent_id`` (None: a new root) and, when ``select``, make it
        the parent's selected child (or the selected root).

        Raises :class:`ConversationError` for an unknown conversation or parent, a parent of
        another conversation, and ``ValueError`` for a role outside ``ROLES``.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        ids = _ids(token_ids)
        ids_json = json.dumps(list(ids)) if ids is not None else None
        meta_json = json.dumps(meta or {})
        now = self.clock()
        with self._tx():
            self._check_conversation(conversation_id)
            if parent_id is not None:
                parent = self.get_node(parent_id)
                if parent.conversation_id != conversation_id:
                    raise ConversationError(
                        f"node {parent_id} belongs to conversation {parent.conversation_id}, "
                        f"not {conversation_id}"
                    )
            cur = self._conn.execute(
                "INSERT INTO nodes (conversation_id, parent_id, role, content, token_ids, "
                "created_at, meta) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, parent_id, role, content, ids_json, now, meta_json),
            )
            nid = cur.lastrowid
            if select:
                self._set_selected(conversation_id, parent_id, nid)
            self._touch(conversation_id)
        return Node(nid, conversation_id, parent_id, role, content, ids, now, dict(meta or {}))

    def get_node(self, node_id: int) -> Node:
        """Raises :class:`ConversationError` for an unknown id."""
        with self._lock:
            row = self._one(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE id = ?", (node_id,))
        if row is None:
            raise ConversationError(f"no node with id {node_id}")
        return _node(row)

    def replace_reply(
        self, node_id: int, content: str, token_ids: Iterable[int] | None, meta: dict[str, Any]
    ) -> Node:
        """Replace a node's content, generated ids and meta in place (a reply continued,
        docs/DESIGN.md §12; an undo puts the old ones back). Raises
        :class:`ConversationError` for an unknown id."""
        ids = _ids(token_ids)
        ids_json = json.dumps(list(ids)) if ids is not None else None
        with self._tx():
            node = self.get_node(node_id)
            self._conn.execute(
                "UPDATE nodes SET content = ?, token_ids = ?, meta = ? WHERE id = ?",
                (content, ids_json, json.dumps(meta), node_id),
            )
            self._touch(node.conversation_id)
        return Node(
            node.id, node.conversation_id, node.parent_id, node.role, content, ids,
            node.created_at, dict(meta),
        )  # fmt: skip

    def update_meta(self, node_id: int, key: str, value: Any) -> None:
        """Set ``meta[key] = value`` (JSON-serializable) on a node, keeping its other
        keys (a verify report next to the turn's metrics). Raises
        :class:`ConversationError` for an unknown id."""
        with self._tx():
            row = self._one("SELECT meta FROM nodes WHERE id = ?", (node_id,))
            if row is None:
                raise ConversationError(f"no node with id {node_id}")
            meta = {**json.loads(row[0] or "{}"), key: value}
            self._conn.execute(
                "UPDATE nodes SET meta = ? WHERE id = ?", (json.dumps(meta), node_id)
            )

    def children(self, node_id: int) -> list[Node]:
        """Children of ``node_id`` in creation order. Raises :class:`ConversationError`."""
        with self._lock:
            self.get_node(node_id)
            rows = self._conn.execute(
                f"SELECT {_NODE_COLUMNS} FROM nodes WHERE parent_id = ? ORDER BY id", (node_id,)
            ).fetchall()
        return [_node(r) for r in rows]

    def roots(self, conversation_id: int) -> list[Node]:
        """Root nodes of a conversation in creation order (siblings of the first message)."""
        with self._lock:
            self._check_conversation(conversation_id)
            rows = self._conn.execute(
                f"SELECT {_NODE_COLUMNS} FROM nodes WHERE conversation_id = ? "
                "AND parent_id IS NULL ORDER BY id",
                (conversation_id,),
            ).fetchall()
        return [_node(r) for r in rows]

    def siblings(self, node_id: int) -> list[Node]:
        """The node and its siblings in creation order."""
        with self._lock:
            node = self.get_node(node_id)
            if node.parent_id is None:
                return self.roots(node.conversation_id)
            return self.children(node.parent_id)

    def _set_selected(self, conversation_id: int, parent_id: int | None, child_id: int | None):
        self.db.set_selected(conversation_id, parent_id, child_id)

    def select_child(self, parent_id: int | None, child_id: int) -> None:
        """Make ``child_id`` the selected child of ``parent_id`` (None: the selected root of
        the child's conversation). Raises :class:`ConversationError` for unknown ids or when
        ``child_id`` is not a child of ``parent_id``."""
        with self._tx():
            child = self.get_node(child_id)
            if child.parent_id != parent_id:
                what = "a root" if parent_id is None else f"a child of node {parent_id}"
                raise ConversationError(f"node {child_id} is not {what}")
            self._set_selected(child.conversation_id, parent_id, child_id)
            self._touch(child.conversation_id)

    def selected_child(
        self, node_id: int | None, conversation_id: int | None = None
    ) -> Node | None:
        """The selected child of ``node_id`` (or the selected root of ``conversation_id`` when
        ``node_id`` is None); the newest child when none is recorded; None for a leaf."""
        with self._lock:
            if node_id is None:
                if conversation_id is None:
                    raise ValueError("selected_child(None) needs a conversation_id")
                self._check_conversation(conversation_id)
                row = self._one(
                    "SELECT selected_root FROM conversations WHERE id = ?", (conversation_id,)
                )
                options = self.roots(conversation_id)
            else:
                row = self._one("SELECT selected_child FROM nodes WHERE id = ?", (node_id,))
                options = self.children(node_id)
        chosen = row[0] if row else None
        for node in options:
            if node.id == chosen:
                return node
        return options[-1] if options else None

    def active_path(self, conversation_id: int) -> list[Node]:
        """Nodes from the selected root through selected children. Raises
        :class:`ConversationError` for an unknown conversation."""
        with self._lock:
            path: list[Node] = []
            node = self.selected_child(None, conversation_id)
            while node is not None:
                path.append(node)
                node = self.selected_child(node.id)
        return path

    def path_to(self, node_id: int) -> list[Node]:
        """Nodes from the root down to ``node_id`` (inclusive)."""
        with self._lock:
            path = [self.get_node(node_id)]
            while path[-1].parent_id is not None:
                path.append(self.get_node(path[-1].parent_id))
        return path[::-1]

    def user_turns(self, conversation_id: int) -> list[Node]:
        """The user nodes on the active path, in order (turn 0 first)."""
        return [n for n in self.active_path(conversation_id) if n.role == "user"]

    def replies(self, user_node_id: int) -> list[Node]:
        """Assistant children of a user node in creation order (the swipe order)."""
        return [n for n in self.children(user_node_id) if n.role == "assistant"]

    def delete_subtree(self, node_id: int) -> None:
        """Delete a node and all its descendants. Where it was the selected child (or root),
        the newest remaining sibling becomes selected. Raises :class:`ConversationError`."""
        with self._tx():
            node = self.get_node(node_id)
            # ON DELETE CASCADE on parent_id removes the descendants
            self._conn.execute("DELETE FROM nodes WHERE id = ?", (node_id,))
            if node.parent_id is None:
                left = self.roots(node.conversation_id)
            else:
                left = self.children(node.parent_id)
            self._set_selected(node.conversation_id, node.parent_id, left[-1].id if left else None)
            self._touch(node.conversation_id)

    def fork(self, node_id: int, title: str | None = None) -> int:
        """A new conversation holding a copy of the path root..``node_id`` (contents, token
        ids, meta). Title defaults to "<old title> (fork)". Returns the new id."""
        with self._tx():
            path = self.path_to(node_id)
            old = self.get_conversation(path[0].conversation_id)
            if title is None:
                title = f"{old.title or f'conversation {old.id}'} (fork)"
            cid = self.create_conversation(title)
            parent = None
            for n in path:
                copy = self.add_node(
                    cid, parent, n.role, n.content, token_ids=n.token_ids, meta=n.meta
                )
                parent = copy.id
        return cid

    def delete_message(self, node_id: int) -> Node | None:
        """Delete one message and keep what follows it: its child (at most one) moves up to
        the message's parent, taking the message's place (selected where it was). Returns
        the moved child, None for a leaf.

        Raises :class:`ConversationError` for an unknown id, or when the message has more
        than one child (its branches would merge into its siblings: delete a branch, with
        :meth:`delete_subtree`, instead)."""
        with self._tx():
            node = self.get_node(node_id)
            kids = self.children(node_id)
            if len(kids) > 1:
                raise ConversationError(
                    f"message {node_id} has {len(kids)} branches after it; delete one of "
                    "them, or this message with everything after it"
                )
            if node.parent_id is None:
                selected = self.selected_child(None, node.conversation_id)
            else:
                selected = self.selected_child(node.parent_id)
            child = kids[0] if kids else None
            if child is not None:
                self._conn.execute(
                    "UPDATE nodes SET parent_id = ? WHERE id = ?", (node.parent_id, child.id)
                )
            self._conn.execute("DELETE FROM nodes WHERE id = ?", (node_id,))
            if selected is not None and selected.id == node_id:
                if child is not None:
                    keep = child.id
                else:
                    left = (
                        self.roots(node.conversation_id)
                        if node.parent_id is None
                        else self.children(node.parent_id)
                    )
                    keep = left[-1].id if left else None
                self._set_selected(node.conversation_id, node.parent_id, keep)
            self._touch(node.conversation_id)
        return self.get_node(child.id) if child is not None else None

    def move_node(self, node_id: int, parent_id: int) -> None:
        """Hang ``node_id`` (and what follows it) under ``parent_id`` of the same
        conversation, selected there (undoing :meth:`delete_message`). Raises
        :class:`ConversationError` for an unknown node or parent, or another conversation."""
        with self._tx():
            node, parent = self.get_node(node_id), self.get_node(parent_id)
            if node.conversation_id != parent.conversation_id:
                raise ConversationError("a message moves only within its conversation")
            # where it was selected, the newest sibling left becomes the selection there
            # (selected_child falls back to it)
            self._conn.execute("UPDATE nodes SET parent_id = ? WHERE id = ?", (parent_id, node_id))
            self._set_selected(node.conversation_id, parent_id, node_id)
            self._touch(node.conversation_id)

    def subtree_size(self, node_id: int) -> int:
        """Messages in the subtree of ``node_id``, itself included (what
        :meth:`delete_subtree` would delete). Raises :class:`ConversationError`."""
        sql = """
        WITH RECURSIVE below(id) AS (
            SELECT ? UNION ALL SELECT n.id FROM nodes n JOIN below ON n.parent_id = below.id
        )
        SELECT count(*) FROM below
        """
        with self._lock:
            self.get_node(node_id)
            return self._conn.execute(sql, (node_id,)).fetchone()[0]

    def select_path(self, node_id: int) -> list[Node]:
        """Make the path root..``node_id`` the selected one at every level (so the active
        path passes through ``node_id``); returns that path. Raises
        :class:`ConversationError` for an unknown id."""
        with self._tx():
            path = self.path_to(node_id)
            for node in path:
                self._set_selected(node.conversation_id, node.parent_id, node.id)
            self._touch(path[0].conversation_id)
        return path

    # ------------------------------------------------------------------ search

    def search(
        self, text: str, *, conversation_id: int | None = None, limit: int = 50
    ) -> list[SearchHit]:
        """Messages whose content holds every word of ``text`` (the last word as a prefix;
        :func:`~tierchat.core.chat.search.fts_query`), best match first (FTS5 ``bm25``), newest
        first among equals; in one conversation or, when ``conversation_id`` is None, in
        all. Every branch is searched, not only the active path. ``[]`` for text without a
        word. Raises :class:`ConversationError` for an unknown conversation."""
        return search_nodes(self.db, text, conversation_id=conversation_id, limit=limit)

    # ------------------------------------------------------------------ import

    def import_conversation(self, conversation: ImportedConversation) -> int:
        """Store a conversation read by :func:`~tierchat.core.chat.importer.parse_export` as a
        new one (new ids; contents, token ids, meta, times, settings and the selected
        branch as exported), in one transaction: on any error nothing is stored. Returns
        the new id."""
        return insert_conversation(self.db, conversation)

    # ------------------------------------------------------------------ one-query reads

    def active_path_entries(self, conversation_id: int) -> list[PathEntry]:
        """The active path (as :meth:`active_path`) with each node's sibling index and
        count among siblings of its role, in one SQL query (a recursive walk of the
        selected children), so a transcript of n messages costs O(n), not O(n^2).
        Raises :class:`ConversationError` for an unknown conversation."""
        sql = f"""
        WITH RECURSIVE path(id, depth) AS (
            SELECT COALESCE(
                (SELECT n.id FROM nodes n, conversations c
                 WHERE c.id = :cid AND n.id = c.selected_root
                   AND n.conversation_id = :cid AND n.parent_id IS NULL),
                (SELECT max(id) FROM nodes WHERE conversation_id = :cid AND parent_id IS NULL)
            ), 0
            UNION ALL
            SELECT COALESCE(
                (SELECT c.id FROM nodes c, nodes p
                 WHERE p.id = path.id AND c.id = p.selected_child AND c.parent_id = p.id),
                (SELECT max(c.id) FROM nodes c WHERE c.parent_id = path.id)
            ), path.depth + 1
            FROM path WHERE path.id IS NOT NULL
        )
        SELECT {", ".join("n." + c.strip() for c in _NODE_COLUMNS.split(","))},
            {SIBLING_INDEX_SQL}, {SIBLING_COUNT_SQL}
        FROM path JOIN nodes n ON n.id = path.id
        ORDER BY path.depth
        """
        with self._lock:
            self._check_conversation(conversation_id)
            rows = self._conn.execute(sql, {"cid": conversation_id}).fetchall()
        return [PathEntry(_node(r[:-2]), r[-2], r[-1]) for r in rows]

    # ------------------------------------------------------------------ settings

    def conversation_settings(self, conversation_id: int) -> dict[str, Any]:
        """The conversation's saved generation settings (a JSON object; ``{}`` when none
        were saved). Raises :class:`ConversationError` for an unknown id."""
        with self._lock:
            row = self._one("SELECT settings FROM conversations WHERE id = ?", (conversation_id,))
        if row is None:
            raise ConversationError(f"no conversation with id {conversation_id}")
        return json.loads(row[0] or "{}")

    def set_conversation_settings(self, conversation_id: int, settings: dict[str, Any]) -> None:
        """Replace the conversation's generation settings (JSON-serializable values).
        Raises :class:`ConversationError` for an unknown id."""
        text = json.dumps(settings, sort_keys=True)
        with self._tx():
            self._check_conversation(conversation_id)
            self._conn.execute(
                "UPDATE conversations SET settings = ? WHERE id = ?", (text, conversation_id)
            )
            self._touch(conversation_id)


def _ids(token_ids: Iterable[int] | None) -> tuple[int, ...] | None:
    return tuple(int(i) for i in token_ids) if token_ids is not None else None
