"""The conversation store's SQLite plumbing (docs/DESIGN.md §12): the schema as
migrations, one connection shared by every thread and serialized by a lock, errors named
by what failed (a locked file is a "busy" :class:`StoreError`), the file created owner-only,
one transaction as one context manager whose failed ``BEGIN`` releases the lock, and the
open file as one :class:`Database` that the store and its search, import and trash
modules share. Pure Python: stdlib ``sqlite3`` only.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..files import private_dirs

if TYPE_CHECKING:
    pass

# Each entry brings the schema from version i to i + 1; never edit a released entry.
# Statements are separated by ``;`` (none inside a string: the entries are split on it).
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        selected_root INTEGER
    );
    CREATE TABLE nodes (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        parent_id INTEGER REFERENCES nodes(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL,
        token_ids TEXT,
        created_at REAL NOT NULL,
        meta TEXT NOT NULL DEFAULT '{}',
        selected_child INTEGER
    );
    CREATE INDEX nodes_by_parent ON nodes(parent_id);
    CREATE INDEX nodes_by_conversation ON nodes(conversation_id);
    """,
    # per-conversation generation settings (system prompt, sampling), a JSON object
    """
    ALTER TABLE conversations ADD COLUMN settings TEXT NOT NULL DEFAULT '{}';
    """,
    # full-text index of every message (core/chat/search.py), kept in step by triggers, and
    # filled from the messages already stored
    """
    CREATE VIRTUAL TABLE nodes_fts USING fts5(
        content, content='nodes', content_rowid='id', tokenize='unicode61 remove_diacritics 2'
    );
    CREATE TRIGGER nodes_fts_insert AFTER INSERT ON nodes BEGIN
        INSERT INTO nodes_fts(rowid, content) VALUES (new.id, new.content);
    END;
    CREATE TRIGGER nodes_fts_delete AFTER DELETE ON nodes BEGIN
        INSERT INTO nodes_fts(nodes_fts, rowid, content) VALUES ('delete', old.id, old.content);
    END;
    CREATE TRIGGER nodes_fts_update AFTER UPDATE OF content ON nodes BEGIN
        INSERT INTO nodes_fts(nodes_fts, rowid, content) VALUES ('delete', old.id, old.content);
        INSERT INTO nodes_fts(rowid, content) VALUES (new.id, new.content);
    END;
    INSERT INTO nodes_fts(nodes_fts) VALUES ('rebuild');
    """,
    # undo history (core/chat/trash.py): the last deletions and replaced replies, each a
    # JSON snapshot; no key to conversations, so a deleted conversation's snapshot stays
    """
    CREATE TABLE trash (
        id INTEGER PRIMARY KEY,
        kind TEXT NOT NULL,
        conversation_id INTEGER NOT NULL,
        label TEXT NOT NULL,
        created_at REAL NOT NULL,
        item TEXT NOT NULL
    );
    """,
    # role "tool" (a tool call's result; docs/DESIGN.md §12.1): SQLite cannot change a
    # CHECK, so the table is rebuilt (renamed away, created again, copied with its ids,
    # the old one dropped; its indexes and the search triggers made again). The old rows'
    # parents are cleared before the drop: a DROP whose implicit delete cascades within
    # the table fails with "table is locked".
    """
    ALTER TABLE nodes RENAME TO nodes_old;
    DROP TRIGGER nodes_fts_insert;
    DROP TRIGGER nodes_fts_delete;
    DROP TRIGGER nodes_fts_update;
    CREATE TABLE nodes (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        parent_id INTEGER REFERENCES nodes(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
        content TEXT NOT NULL,
        token_ids TEXT,
        created_at REAL NOT NULL,
        meta TEXT NOT NULL DEFAULT '{}',
        selected_child INTEGER
    );
    INSERT INTO nodes (id, conversation_id, parent_id, role, content, token_ids, created_at,
        meta, selected_child)
        SELECT id, conversation_id, parent_id, role, content, token_ids, created_at, meta,
        selected_child FROM nodes_old;
    UPDATE nodes_old SET parent_id = NULL;
    DROP TABLE nodes_old;
    CREATE INDEX nodes_by_parent ON nodes(parent_id);
    CREATE INDEX nodes_by_conversation ON nodes(conversation_id);
    CREATE TRIGGER nodes_fts_insert AFTER INSERT ON nodes BEGIN
        INSERT INTO nodes_fts(rowid, content) VALUES (new.id, new.content);
    END;
    CREATE TRIGGER nodes_fts_delete AFTER DELETE ON nodes BEGIN
        INSERT INTO nodes_fts(nodes_fts, rowid, content) VALUES ('delete', old.id, old.content);
    END;
    CREATE TRIGGER nodes_fts_update AFTER UPDATE OF content ON nodes BEGIN
        INSERT INTO nodes_fts(nodes_fts, rowid, content) VALUES ('delete', old.id, old.content);
        INSERT INTO nodes_fts(rowid, content) VALUES (new.id, new.content);
    END;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


def _statements(script: str) -> list[str]:
    """The SQL statements of ``script``, split where ``sqlite3.complete_statement`` says
    one ends (so a trigger's ``BEGIN ... ; ... END`` body stays whole)."""
    out, current = [], ""
    for piece in script.split(";"):
        current += piece + ";"
        if sqlite3.complete_statement(current):
            if current.strip(" \n\t;"):
                out.append(current)
            current = ""
    if current.strip(" \n\t;"):
        out.append(current)
    return out


BUSY_TIMEOUT_S = 10.0  # how long a connection waits for another process's lock


StoreErrorKind = Literal[
    "full", "readonly", "ioerr", "cantopen", "busy", "corrupt", "schema", "other"
]

# SQLite primary result code name -> (kind, what to tell the user)
_SQLITE_KINDS: dict[str, tuple[StoreErrorKind, str]] = {
    "SQLITE_FULL": ("full", "the disk is full"),
    "SQLITE_READONLY": ("readonly", "the store is read-only"),
    "SQLITE_IOERR": ("ioerr", "a disk I/O error"),
    "SQLITE_CANTOPEN": ("cantopen", "the file cannot be opened or created"),
    "SQLITE_PERM": ("readonly", "permission denied"),
    "SQLITE_BUSY": ("busy", "the store is locked by another process"),
    "SQLITE_LOCKED": ("busy", "the store is locked"),
    "SQLITE_NOTADB": ("corrupt", "not a tierchat conversation store"),
    "SQLITE_CORRUPT": ("corrupt", "the file is corrupt"),
}


class StoreError(Exception):
    """A problem with the store file: ``kind`` names it ("full", "readonly", "ioerr",
    "cantopen", "busy", "corrupt", "schema", "other")."""

    def __init__(self, message: str, kind: StoreErrorKind = "other") -> None:
        super().__init__(message)
        self.kind = kind


def store_error(e: sqlite3.Error, path: str, doing: str = "") -> StoreError:
    """A :class:`StoreError` named for what the SQLite error ``e`` is (FULL, READONLY,
    IOERR, CANTOPEN...), from its ``sqlite_errorname`` (extended codes such as
    ``SQLITE_IOERR_WRITE`` map to their primary code)."""
    name = getattr(e, "sqlite_errorname", "") or ""
    kind, what = "other", str(e)
    for prefix, (k, text) in _SQLITE_KINDS.items():
        if name == prefix or name.startswith(prefix + "_"):
            kind, what = k, text
            break
    else:  # older SQLite bindings: match the message
        low = str(e).lower()
        for needle, k, text in (
            ("disk is full", "full", "the disk is full"),
            ("readonly", "readonly", "the store is read-only"),
            ("disk i/o", "ioerr", "a disk I/O error"),
            ("unable to open", "cantopen", "the file cannot be opened or created"),
            ("not a database", "corrupt", "not a tierchat conversation store"),
        ):
            if needle in low:
                kind, what = k, text
                break
    verb = f"cannot {doing}: " if doing else ""
    return StoreError(f"{path}: {verb}{what} ({e})", kind)


class _Conn:
    """The SQLite connection, raising :class:`StoreError` (named for its cause) instead of
    ``sqlite3`` errors, so a full or read-only disk is a message, not a traceback."""

    def __init__(self, conn: sqlite3.Connection, path: str) -> None:
        self._conn = conn
        self._path = path

    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction

    def execute(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        try:
            return self._conn.execute(sql, args)
        except sqlite3.IntegrityError:
            raise  # a constraint: the caller's business, not the disk's
        except sqlite3.Error as e:
            raise store_error(e, self._path, _doing(sql)) from None

    def executescript(self, sql: str) -> sqlite3.Cursor:
        try:
            return self._conn.executescript(sql)
        except sqlite3.Error as e:
            if self._conn.in_transaction:
                try:
                    self._conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            raise store_error(e, self._path, "update the store") from None

    def close(self) -> None:
        self._conn.close()


def _doing(sql: str) -> str:
    verb = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else ""
    return "save" if verb in ("INSERT", "UPDATE", "DELETE", "COMMIT", "BEGIN") else "read"


def _private_file(path: Path) -> None:
    """Create the store's directory (missing parts 0700) and file (0600) before SQLite
    does, and tighten an existing file to 0600; SQLite gives its -wal and -shm files the
    database file's mode."""
    private_dirs(path.parent)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        try:
            if path.stat().st_mode & 0o077:
                path.chmod(0o600)
        except OSError:
            pass  # someone else's file or a read-only disk: SQLite will say what it can do


@contextmanager
def _transaction(conn: _Conn, lock: threading.RLock) -> Iterator[None]:
    """Hold the store lock and one SQLite transaction; nested use joins the outer one.

    The lock is taken by a ``with`` that also covers ``BEGIN``, so a ``BEGIN IMMEDIATE``
    that fails (the file locked by another process past the busy timeout: a
    :class:`StoreError` of kind "busy") releases it again. Body errors roll the
    transaction back; a failed ``COMMIT`` rolls back and raises."""
    with lock:
        outer = not conn.in_transaction
        if outer:
            conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if outer and conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except StoreError:
                    pass
            raise
        if outer:
            try:
                conn.execute("COMMIT")
            except StoreError:
                if conn.in_transaction:  # a failed COMMIT: undo the turn's write
                    try:
                        conn.execute("ROLLBACK")
                    except StoreError:
                        pass
                raise


class ConversationError(StoreError, KeyError):
    """An unknown conversation or node id, or an operation the tree does not allow."""

    def __str__(self) -> str:  # KeyError would repr-quote the message
        return str(self.args[0]) if self.args else ""


# A node ``n``'s place among its siblings of the same role, and their number (the
# transcript's ‹ n/m ›); roots are the siblings of a conversation's first message.
SIBLING_INDEX_SQL = """CASE WHEN n.parent_id IS NULL THEN
        (SELECT count(*) FROM nodes s WHERE s.conversation_id = n.conversation_id
           AND s.parent_id IS NULL AND s.role = n.role AND s.id < n.id)
    ELSE
        (SELECT count(*) FROM nodes s
         WHERE s.parent_id = n.parent_id AND s.role = n.role AND s.id < n.id)
    END"""
SIBLING_COUNT_SQL = """CASE WHEN n.parent_id IS NULL THEN
        (SELECT count(*) FROM nodes s WHERE s.conversation_id = n.conversation_id
           AND s.parent_id IS NULL AND s.role = n.role)
    ELSE
        (SELECT count(*) FROM nodes s WHERE s.parent_id = n.parent_id AND s.role = n.role)
    END"""


class Database:
    """One store file, open: its connection ``conn`` (raising :class:`StoreError`), the
    re-entrant ``lock`` every thread holds around it, and the ``clock`` that stamps rows
    (epoch seconds). The store (core/chat/store.py) and the modules that read or write its
    tables for it (search, import, trash) share one (docs/DESIGN.md §12).

    Opening creates the file owner-only, sets WAL and applies the missing steps of
    :data:`MIGRATIONS`, retrying while another process holds the file busy for up to
    ``busy_timeout_s`` seconds. Raises :class:`StoreError` when the file is not a SQLite
    database, or (kind "schema") was written by a newer tierchat."""

    def __init__(self, path: str, clock: Callable[[], float], busy_timeout_s: float) -> None:
        self.path, self.clock, self.busy_timeout_s = path, clock, busy_timeout_s
        if path != ":memory:":
            _private_file(Path(path))
        self.lock = threading.RLock()
        try:
            conn = sqlite3.connect(
                path, check_same_thread=False, isolation_level=None, timeout=busy_timeout_s
            )
        except sqlite3.Error as e:
            raise store_error(e, path, "open the store") from None
        self.conn = _Conn(conn, path)
        try:
            self._setup()
        except StoreError:
            self.conn.close()
            raise

    def _setup(self) -> None:
        """Set WAL and migrate, retrying while another process holds the file busy: the
        first switch to WAL can answer SQLITE_BUSY without calling the busy handler."""
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                return self._migrate()
            except StoreError as e:
                if e.kind != "busy" or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _migrate(self) -> None:
        conn = self.conn
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: conversation store schema version {version} is newer than this "
                f"tierchat supports ({SCHEMA_VERSION}); upgrade tierchat or use another data dir",
                "schema",
            )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA foreign_keys=ON")
        if version == SCHEMA_VERSION:
            return
        # one writer migrates: BEGIN IMMEDIATE takes the write lock (waiting up to the busy
        # timeout), and the version is read again under it, so a process that lost the race
        # finds the schema already there and applies nothing
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            for step in MIGRATIONS[version:SCHEMA_VERSION]:
                # statement by statement: executescript would commit the open transaction
                for sql in _statements(step):
                    conn.execute(sql)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    def transaction(self) -> AbstractContextManager[None]:
        """The lock and one SQLite transaction; nested use joins the outer one."""
        return _transaction(self.conn, self.lock)

    def one(self, sql: str, args: Iterable = ()) -> tuple | None:
        """The first row of ``sql`` (the caller holds :attr:`lock`), or None."""
        return self.conn.execute(sql, tuple(args)).fetchone()

    def check_conversation(self, conversation_id: int) -> None:
        """Raises :class:`ConversationError` when no conversation has this id."""
        if self.one("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)) is None:
            raise ConversationError(f"no conversation with id {conversation_id}")

    def touch(self, conversation_id: int) -> None:
        """Stamp the conversation's ``updated_at`` with :attr:`clock`."""
        self.conn.execute(
            "UPDATE conversations SET updated_at = ? WHERE id = ?", (self.clock(), conversation_id)
        )

    def set_selected(self, conversation_id: int, parent_id: int | None, child_id: int | None):
        """Record ``child_id`` as the selected child of ``parent_id`` (None: the
        conversation's selected root)."""
        if parent_id is None:
            self.conn.execute(
                "UPDATE conversations SET selected_root = ? WHERE id = ?",
                (child_id, conversation_id),
            )
        else:
            self.conn.execute(
                "UPDATE nodes SET selected_child = ? WHERE id = ?", (child_id, parent_id)
            )
