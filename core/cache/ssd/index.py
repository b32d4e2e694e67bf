"""The SSD tier's index: what it holds, in LRU order, as chains (docs/DESIGN.md §8.4).

A mapping of entry id to :class:`~.format.FileMeta`, least recently used first, with the
ids of each parent's children and the bytes held, and the order in which entries are
evicted (:meth:`EntryIndex.victim`). Pure bookkeeping: no file, no thread, no lock (the
tier's lock guards it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ..blocks import KIND_BLOCK, EntryMeta
from .format import FileMeta


class EntryIndex(Mapping[str, FileMeta]):
    """Entries by id, least recently used first; ``nbytes``: their files' bytes in all.
    ``root``: the id every chain starts from (a block whose parent is the root is held
    whatever else is)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._by_id: dict[str, FileMeta] = {}
        self._children: dict[str, set[str]] = {}  # parent id -> ids of entries after it
        self.nbytes = 0

    def __getitem__(self, entry_id: str) -> FileMeta:
        return self._by_id[entry_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._by_id

    def get(self, entry_id: str, default: FileMeta | None = None) -> FileMeta | None:
        return self._by_id.get(entry_id, default)

    def holds(self, e: EntryMeta) -> bool:
        """Whether ``e``'s id is held with at least the parts ``e`` carries (its window,
        snapshot and logprobs), so that writing ``e`` would add nothing."""
        old = self._by_id.get(e.id)
        return (
            old is not None
            and (old.window or not e.window)
            and (old.snapshot or not e.snapshot)
            and (old.logprobs or not e.logprobs)
        )

    def add(self, meta: FileMeta) -> None:
        """Hold ``meta`` as the most recently used entry (replacing one of its id)."""
        old = self._by_id.pop(meta.id, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._by_id[meta.id] = meta
        self.nbytes += meta.nbytes
        self._children.setdefault(meta.parent, set()).add(meta.id)

    def pop(self, entry_id: str) -> FileMeta | None:
        """Forget ``entry_id``; its meta, or None when it was not held."""
        meta = self._by_id.pop(entry_id, None)
        if meta is None:
            return None
        self.nbytes -= meta.nbytes
        ids = self._children.get(meta.parent)
        if ids is not None:
            ids.discard(entry_id)
            if not ids:
                del self._children[meta.parent]
        return meta

    def touch(self, meta: FileMeta) -> None:
        """``meta`` (of a held entry) replaces its row as the most recently used."""
        del self._by_id[meta.id]
        self._by_id[meta.id] = meta

    def children_of(self, parent: str) -> list[FileMeta]:
        """Entries (blocks and tails) whose parent is ``parent``, in id order."""
        return [self._by_id[i] for i in sorted(self._children.get(parent, ()))]

    def tail_ids(self) -> list[str]:
        return [i for i, m in self._by_id.items() if m.kind != KIND_BLOCK]

    def victim(self, keep: str | None = None) -> str | None:
        """The entry to evict next: the least recently used one that no entry held
        continues (a leaf of its chain), other than ``keep``. A restore walks a chain from
        the root, so a block whose descendants stayed would leave them unreachable: chains
        shrink from their ends, least recently used chain first. An entry whose parent is
        not held (admission may write a child before its parent) is unreachable and goes
        first. None when only ``keep`` is left."""
        leaf = None
        for entry_id, meta in self._by_id.items():  # least recently used first
            if self._children.get(entry_id) or entry_id == keep:
                continue
            if meta.parent != self.root and meta.parent not in self._by_id:
                return entry_id
            leaf = leaf or entry_id
        return leaf
