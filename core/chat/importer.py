"""Read a conversation back from its JSON export (``tui/export.py``, format
"tierchat-conversation" version 1), checked before anything is stored.

Both scopes are read: ``"path"`` (a ``messages`` list: a chain, every message active) and
``"tree"`` (``roots``, each node with its ``children``; ``active`` marks the selected
branch). :func:`parse_export` checks every field and raises :class:`ImportFormatError`
naming the first bad one (``roots[0].children[1].role``); ``ConversationStore.
import_conversation`` stores the result in one transaction (:func:`insert_conversation`),
so a bad file stores nothing.
Pure Python, stdlib only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sqlite import Database

FORMAT = "tierchat-conversation"
VERSIONS = (1,)
MAX_BYTES = 64 << 20
"""Largest file :func:`read_export` reads (bytes); a bigger one is refused unread."""

_ROLES = ("system", "user", "assistant", "tool")


class ImportFormatError(ValueError):
    """The file is not a tierchat conversation export, or one of its fields is wrong;
    the message names the file (when read from one) and the field."""


@dataclass(frozen=True)
class ImportedNode:
    """One message of an export; ``active``: on the selected branch."""

    role: str
    content: str
    token_ids: tuple[int, ...] | None
    created_at: float
    meta: dict[str, Any]
    active: bool
    children: tuple[ImportedNode, ...] = field(default=())


@dataclass(frozen=True)
class ImportedConversation:
    """A checked export: title, times (epoch seconds), saved settings and the message tree."""

    title: str | None
    created_at: float
    updated_at: float
    settings: dict[str, Any]
    roots: tuple[ImportedNode, ...]

    def count(self) -> int:
        """Messages in the tree."""
        n, stack = 0, list(self.roots)
        while stack:
            node = stack.pop()
            n += 1
            stack.extend(node.children)
        return n


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ImportFormatError(f"{where}: expected a number, got {value!r:.40}")
    return float(value)


def _node(raw: Any, where: str, *, chain_active: bool | None) -> tuple[dict, list]:
    """The checked fields of one node (without children) and its raw children."""
    if not isinstance(raw, dict):
        raise ImportFormatError(f"{where}: expected an object, got {type(raw).__name__}")
    role = raw.get("role")
    if role not in _ROLES:
        raise ImportFormatError(f"{where}.role: expected one of {_ROLES}, got {role!r:.40}")
    content = raw.get("content")
    if not isinstance(content, str):
        raise ImportFormatError(f"{where}.content: expected a string")
    ids = raw.get("token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise ImportFormatError(f"{where}.token_ids: expected null or non-negative ints")
        ids = tuple(ids)
    meta = raw.get("meta", {})
    if not isinstance(meta, dict):
        raise ImportFormatError(f"{where}.meta: expected an object")
    created = _number(raw.get("created_at", 0.0), f"{where}.created_at")
    active = raw.get("active", True) if chain_active is None else chain_active
    if not isinstance(active, bool):
        raise ImportFormatError(f"{where}.active: expected true or false")
    children = raw.get("children", [])
    if not isinstance(children, list):
        raise ImportFormatError(f"{where}.children: expected a list")
    fields = {
        "role": role,
        "content": content,
        "token_ids": ids,
        "created_at": created,
        "meta": meta,
        "active": active,
    }
    return fields, children


def _tree(raw_roots: list, where: str) -> tuple[ImportedNode, ...]:
    """Nodes built bottom-up without recursion (an export nests one level per message)."""
    # post-order over (raw, where) with an explicit stack
    order: list[tuple[dict, list[str]]] = []
    built: dict[str, ImportedNode] = {}
    stack = [(r, f"{where}[{i}]") for i, r in enumerate(raw_roots)][::-1]
    while stack:
        raw, here = stack.pop()
        fields, children = _node(raw, here, chain_active=None)
        kids = [f"{here}.children[{i}]" for i in range(len(children))]
        order.append((fields | {"_where": here}, kids))
        stack.extend((c, f"{here}.children[{i}]") for i, c in reversed(list(enumerate(children))))
    for fields, kids in reversed(order):
        here = fields.pop("_where")
        built[here] = ImportedNode(**fields, children=tuple(built.pop(k) for k in kids))
    return tuple(built[f"{where}[{i}]"] for i in range(len(raw_roots)))


def _chain(raw_messages: list) -> tuple[ImportedNode, ...]:
    fields = [_node(m, f"messages[{i}]", chain_active=True)[0] for i, m in enumerate(raw_messages)]
    node: ImportedNode | None = None
    for f in reversed(fields):
        node = ImportedNode(**f, children=(node,) if node is not None else ())
    return (node,) if node is not None else ()


def _check_active(roots: tuple[ImportedNode, ...]) -> None:
    """At most one active node among any set of siblings."""
    stack = [roots]
    while stack:
        siblings = stack.pop()
        if sum(n.active for n in siblings) > 1:
            raise ImportFormatError("two sibling messages are both marked active")
        stack.extend(n.children for n in siblings)


def parse_export(text: str) -> ImportedConversation:
    """The conversation in ``text`` (an export's JSON). Raises :class:`ImportFormatError`
    for anything that is not a valid version-1 export (bad JSON, unknown format or
    version, a missing or ill-typed field), naming the field."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ImportFormatError(f"not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ImportFormatError(f'not a tierchat conversation export (no "format": "{FORMAT}")')
    if doc.get("version") not in VERSIONS:
        raise ImportFormatError(f"export version {doc.get('version')!r} is not supported")
    title = doc.get("title")
    if title is not None and not isinstance(title, str):
        raise ImportFormatError("title: expected a string")
    settings = doc.get("settings", {})
    if not isinstance(settings, dict):
        raise ImportFormatError("settings: expected an object")
    created = _number(doc.get("created_at", 0.0), "created_at")
    updated = _number(doc.get("updated_at", created), "updated_at")
    if "roots" in doc:
        if not isinstance(doc["roots"], list):
            raise ImportFormatError("roots: expected a list")
        roots = _tree(doc["roots"], "roots")
        _check_active(roots)
    elif "messages" in doc:
        if not isinstance(doc["messages"], list):
            raise ImportFormatError("messages: expected a list")
        roots = _chain(doc["messages"])
    else:
        raise ImportFormatError('no "messages" (path export) or "roots" (tree export)')
    return ImportedConversation(title, created, updated, settings, roots)


def read_export(path: str | Path) -> ImportedConversation:
    """:func:`parse_export` of a file. Raises :class:`ImportFormatError` (naming the file)
    for an unreadable file, one over :data:`MAX_BYTES`, or a bad export."""
    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ImportFormatError(f"{path}: {size:,} bytes, over the {MAX_BYTES:,} limit")
        text = path.read_text(encoding="utf-8")
    except ImportFormatError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        raise ImportFormatError(f"{path}: cannot read it ({e})") from None
    try:
        return parse_export(text)
    except ImportFormatError as e:
        raise ImportFormatError(f"{path}: {e}") from None


def insert_conversation(db: Database, conversation: ImportedConversation) -> int:
    """Store ``conversation`` (read by :func:`parse_export`) in the store's database ``db``
    as a new one (new ids; contents, token ids, meta, times, settings and the selected
    branch as exported), in one transaction: on any error nothing is stored. Returns the
    new id (``ConversationStore.import_conversation``)."""
    with db.transaction():
        cur = db.conn.execute(
            "INSERT INTO conversations (title, created_at, updated_at, settings) "
            "VALUES (?, ?, ?, ?)",
            (
                conversation.title,
                conversation.created_at,
                conversation.updated_at,
                json.dumps(conversation.settings, sort_keys=True),
            ),
        )
        cid = cur.lastrowid
        stack: list[tuple[int | None, tuple[ImportedNode, ...]]] = [(None, conversation.roots)]
        while stack:
            parent, siblings = stack.pop()
            chosen = None
            for node in siblings:
                ids = node.token_ids
                cur = db.conn.execute(
                    "INSERT INTO nodes (conversation_id, parent_id, role, content, "
                    "token_ids, created_at, meta) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        cid,
                        parent,
                        node.role,
                        node.content,
                        json.dumps(list(ids)) if ids is not None else None,
                        node.created_at,
                        json.dumps(node.meta),
                    ),
                )
                if node.active:
                    chosen = cur.lastrowid
                if node.children:
                    stack.append((cur.lastrowid, node.children))
            if chosen is not None:
                db.set_selected(cid, parent, chosen)
    return cid
