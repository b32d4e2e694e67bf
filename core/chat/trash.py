"""Undo for deletions: what a delete removed, kept so that it can be put back
(docs/DESIGN.md §12).

A :class:`Trash` holds the last :data:`TRASH_ITEMS` deletions of a process (a conversation,
a branch, or one message), each as a snapshot taken before the delete: the messages
with their content, generated token ids, meta and times, and which branch was selected.
:meth:`Trash.restore` puts the newest one back: a conversation is imported again (a new
id, as :meth:`~.store.ConversationStore.import_conversation` does), a branch is added
again under its parent, a message is added again under its parent and the message that
had moved up into its place moves back under it. Restored messages get new ids; their
generated token ids come back with them, so the prompts that splice them (and the cache
entries keyed by those ids) are the ones they were.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from .importer import ImportedConversation, ImportedNode
from .store import ConversationStore, Node

TRASH_ITEMS = 20
"""Deletions kept for undo, newest first out."""

DeletedKind = Literal["conversation", "branch", "message"]


@dataclass(frozen=True)
class Deleted:
    """One deletion. ``parent_id``: where a branch or message hung (None: a root);
    ``moved_id``: the message that moved up into a deleted message's place (None: none);
    ``label``: what the UI calls it ("“Paris trip”", "3 messages")."""

    kind: DeletedKind
    conversation_id: int
    parent_id: int | None
    root: ImportedNode | None
    conversation: ImportedConversation | None
    moved_id: int | None
    label: str


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


class Trash:
    """The last deletions, newest first out. Each ``delete_*`` snapshots, deletes through
    the store and keeps the snapshot; errors of the store propagate (nothing is kept)."""

    def __init__(self, store: ConversationStore, size: int = TRASH_ITEMS) -> None:
        self.store = store
        self.items: deque[Deleted] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self.items)

    def delete_conversation(self, conversation_id: int) -> None:
        snap = snapshot_conversation(self.store, conversation_id)
        self.store.delete_conversation(conversation_id)
        label = f"“{snap.title}”" if snap.title else f"conversation {conversation_id}"
        self.items.append(Deleted("conversation", conversation_id, None, None, snap, None, label))

    def delete_branch(self, node_id: int) -> None:
        node = self.store.get_node(node_id)
        snap = snapshot_node(self.store, node)
        n = self.store.subtree_size(node_id)
        self.store.delete_subtree(node_id)
        label = f"{n} message{'s' if n != 1 else ''}"
        self.items.append(
            Deleted("branch", node.conversation_id, node.parent_id, snap, None, None, label)
        )

    def delete_message(self, node_id: int) -> Node | None:
        """As :meth:`~.store.ConversationStore.delete_message`; returns the moved child."""
        node = self.store.get_node(node_id)
        snap = snapshot_node(self.store, node)
        moved = self.store.delete_message(node_id)
        leaf = ImportedNode(
            snap.role, snap.content, snap.token_ids, snap.created_at, snap.meta, True
        )
        self.items.append(
            Deleted(
                "message",
                node.conversation_id,
                node.parent_id,
                leaf,
                None,
                moved.id if moved is not None else None,
                f"the {node.role} message",
            )
        )
        return moved

    def restore(self) -> tuple[Deleted, int, int | None]:
        """Put the newest deletion back: ``(what, conversation id, restored node id)``
        (node None for a conversation). Raises ``IndexError`` when the trash is empty and
        ``ConversationError`` when the place it hung from is gone too (it stays out)."""
        item = self.items.pop()
        store = self.store
        try:
            if item.kind == "conversation":
                return item, store.import_conversation(item.conversation), None
            top = self._add(item.conversation_id, item.parent_id, item.root)
            if item.kind == "message" and item.moved_id is not None:
                store.move_node(item.moved_id, top)
            return item, item.conversation_id, top
        except Exception:
            self.items.append(item)
            raise

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
