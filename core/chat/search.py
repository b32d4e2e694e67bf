"""Full-text search over stored messages: the query a user types as an SQLite FTS5
expression, and the hits the store returns (``ConversationStore.search``).

The store keeps an FTS5 index of every node's content (``nodes_fts``, an external-content
table over ``nodes``, kept in step by triggers on insert, update and delete; see
``core/chat/store.py`` MIGRATIONS). FTS5 syntax (https://sqlite.org/fts5.html §3) would
let a stray quote or ``AND`` in the typed text become a syntax error or an operator, so
:func:`fts_query` turns the text into plain terms: every word quoted, all required, the
last one a prefix (so results appear while a word is still being typed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .sqlite import SIBLING_COUNT_SQL, SIBLING_INDEX_SQL

if TYPE_CHECKING:
    from .sqlite import Database

MARK_START = "\x02"
"""Marks the start of a matched term in the snippet SQLite returns (never in stored text
shown to the user: :func:`split_marks` removes the marks)."""
MARK_END = "\x03"

_WORD = re.compile(r"\w+", re.UNICODE)


def fts_query(text: str) -> str | None:
    """The FTS5 MATCH expression for what the user typed: each word (``\\w+``, Unicode)
    as a quoted string, all of them required (implicit AND), the last one a prefix
    (``"cach"*`` matches "cache" and "caching"). None when ``text`` has no word."""
    words = _WORD.findall(text)
    if not words:
        return None
    terms = [f'"{w}"' for w in words]
    terms[-1] += "*"
    return " ".join(terms)


def split_marks(snippet: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """``snippet`` without :data:`MARK_START`/:data:`MARK_END`, and the ``(start, end)``
    character spans they enclosed in the cleaned text."""
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    start = None
    n = 0
    for ch in snippet:
        if ch == MARK_START:
            start = n
        elif ch == MARK_END:
            if start is not None:
                spans.append((start, n))
            start = None
        else:
            out.append(ch)
            n += 1
    return "".join(out), tuple(spans)


@dataclass(frozen=True)
class SearchHit:
    """One message that matched: where it is, and a one-line ``snippet`` of its content
    around the match with the matched terms at ``marks`` (character spans)."""

    node_id: int
    conversation_id: int
    title: str
    role: str
    snippet: str
    marks: tuple[tuple[int, int], ...]
    created_at: float
    index: int = 0
    """Its place (0-based) among its siblings of the same role (regenerated replies,
    continued replies, edited messages), as the transcript's ``‹ n/m ›`` counts them."""
    count: int = 1
    """How many siblings of its role there are, itself included."""
    n_tokens: int | None = None
    """Token ids stored with it (a reply's generated tokens); None when none were kept."""
    n_chars: int = 0
    """Characters of its content."""


def search_nodes(
    db: Database, text: str, *, conversation_id: int | None = None, limit: int = 50
) -> list[SearchHit]:
    """The hits of ``ConversationStore.search`` in the store's database ``db``: messages
    whose content holds every word of ``text`` (:func:`fts_query`), best match first (FTS5
    ``bm25``), newest first among equals, at most ``limit``; in one conversation or, when
    ``conversation_id`` is None, in all. ``[]`` for text without a word. Raises
    ``ConversationError`` for an unknown conversation."""
    query = fts_query(text)
    if query is None:
        return []
    where = "nodes_fts MATCH ?"
    args: list[Any] = [query]
    if conversation_id is not None:
        where += " AND n.conversation_id = ?"
        args.append(conversation_id)
    sql = (
        "SELECT n.id, n.conversation_id, c.title, n.role, n.created_at, "
        f"snippet(nodes_fts, 0, '{MARK_START}', '{MARK_END}', '…', 16), "
        f"{SIBLING_INDEX_SQL}, {SIBLING_COUNT_SQL}, "
        "json_array_length(n.token_ids), length(n.content) "
        "FROM nodes_fts JOIN nodes n ON n.id = nodes_fts.rowid "
        "JOIN conversations c ON c.id = n.conversation_id "
        f"WHERE {where} ORDER BY bm25(nodes_fts), n.created_at DESC, n.id DESC LIMIT ?"
    )
    args.append(int(limit))
    with db.lock:
        if conversation_id is not None:
            db.check_conversation(conversation_id)
        rows = db.conn.execute(sql, tuple(args)).fetchall()
    hits = []
    for nid, cid, title, role, created_at, snippet, index, count, n_tokens, n_chars in rows:
        clean, marks = split_marks(" ".join(snippet.split()))
        name = title or f"conversation {cid}"
        hits.append(
            SearchHit(
                nid, cid, name, role, clean, marks, created_at, index, count, n_tokens, n_chars
            )
        )
    return hits
