"""The SQL of undo (docs/DESIGN.md §12): the store's ``trash`` table, where
:mod:`~tierchat.core.chat.trash` keeps its snapshots, and a reply replaced in place (a
continue grows it; an undo puts the cut version back).

A :class:`UndoRows` shares its :class:`~tierchat.core.chat.store.ConversationStore`'s
connection and lock (the store makes one, ``store.undo``), so :meth:`UndoRows.transaction`
and the store's own writes join one SQLite transaction. Pure Python: stdlib only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

from .sqlite import _Conn, _transaction


class UndoRows:
    """Rows of the ``trash`` table, ``(id, kind, conversation_id, label, item)``, ``item``
    a JSON snapshot, newest last; at most ``keep`` of them (the oldest dropped)."""

    def __init__(self, conn: _Conn, lock: threading.RLock, clock: Callable[[], float]) -> None:
        self._conn, self._lock, self.clock = conn, lock, clock

    def transaction(self) -> AbstractContextManager[None]:
        """One transaction around several calls, the store's included (each joins it)."""
        return _transaction(self._conn, self._lock)

    def count(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM trash").fetchone()[0]

    def push(self, kind: str, conversation_id: int, label: str, item: str, keep: int) -> None:
        """Add a row, keeping the newest ``keep``."""
        with self.transaction():
            self._conn.execute(
                "INSERT INTO trash (kind, conversation_id, label, created_at, item) "
                "VALUES (?, ?, ?, ?, ?)",
                (kind, conversation_id, label, self.clock(), item),
            )
            self._conn.execute(
                "DELETE FROM trash WHERE id NOT IN (SELECT id FROM trash ORDER BY id DESC LIMIT ?)",
                (keep,),
            )

    def newest(self) -> tuple[int, str, int, str, str] | None:
        """The newest row, or None when the table is empty."""
        with self._lock:
            return self._conn.execute(
                "SELECT id, kind, conversation_id, label, item FROM trash ORDER BY id DESC LIMIT 1"
            ).fetchone()

    def remove(self, row_id: int) -> None:
        with self.transaction():
            self._conn.execute("DELETE FROM trash WHERE id = ?", (row_id,))

    def replace_reply(
        self, node_id: int, content: str, token_ids: Iterable[int] | None, meta: dict[str, Any]
    ) -> None:
        """Replace node ``node_id``'s content, generated ids and meta in place (the
        full-text index follows through its trigger) and touch its conversation. Raises
        ``KeyError`` for an unknown id."""
        ids = json.dumps([int(t) for t in token_ids]) if token_ids is not None else None
        with self.transaction():
            row = self._conn.execute(
                "SELECT conversation_id FROM nodes WHERE id = ?", (node_id,)
            ).fetchone()
            if row is None:
                raise KeyError(f"no node with id {node_id}")
            self._conn.execute(
                "UPDATE nodes SET content = ?, token_ids = ?, meta = ? WHERE id = ?",
                (content, ids, json.dumps(meta), node_id),
            )
            self._conn.execute(
                "UPDATE conversations SET updated_at = ? WHERE id = ?", (self.clock(), row[0])
            )
