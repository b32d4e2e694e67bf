"""The hot tier: evaluated entries in RAM under one byte budget.

Blocks, MRU tails and checkpoints share the budget. Eviction is LRU inside priority
classes: blocks ending in assistant messages go first, then user, then tails/checkpoints,
then system; entries of a pinned system prompt never go. Tails and checkpoints are also
bounded by count (``max_tails`` for prompt tails and sequence ends, ``max_checkpoints`` for
message-boundary checkpoints). An evicted entry not yet on the SSD tier is written then
(unless covered: docs/DESIGN.md §8.6).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .blocks import KIND_BLOCK, KIND_BOUNDARY, KIND_SEQ, Entry


class HotTier:
    def __init__(
        self,
        max_bytes: int,
        max_tails: int = 64,
        max_checkpoints: int = 32,
        on_evict: Callable[[Entry, str], None] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.configured_bytes = max_bytes
        self.max_tails = max_tails
        self.max_checkpoints = max_checkpoints
        self._on_evict = on_evict or (lambda e, why: None)
        self._lru: dict[int, OrderedDict[str, Entry]] = {}
        self._entries: dict[str, Entry] = {}
        self._tails: OrderedDict[str, Entry] = OrderedDict()
        self._checkpoints: OrderedDict[str, Entry] = OrderedDict()
        self.children: dict[str, set[str]] = {}  # parent id -> ids of entries after it
        self.pinned: set[str] = set()
        self.nbytes = 0
        self.reserved = 0  # bytes of the budget held by the resident cache
        self.snapshot_count = 0
        self.snapshot_nbytes = 0
        self.tail_nbytes = 0  # tails and checkpoints
        self.evictions = 0
        self.tail_evictions = 0

    # ------------------------------------------------------------------ queries
    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, entry_id: str) -> Entry | None:
        return self._entries.get(entry_id)

    def get(self, entry_id: str) -> Entry | None:
        """Return an entry and mark it most recently used."""
        e = self._entries.get(entry_id)
        if e is not None:
            self._lru[e.priority].move_to_end(entry_id)
            bounded = self._bound_for(e)
            if bounded is not None:
                bounded.move_to_end(entry_id)
        return e

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    @property
    def n_tails(self) -> int:
        return len(self._tails)

    @property
    def n_checkpoints(self) -> int:
        """Boundary checkpoints (bounded by ``max_checkpoints``)."""
        return len(self._checkpoints)

    @property
    def n_seq(self) -> int:
        """Sequence ends (prompt + reply), held among the tails and bounded with them."""
        return sum(1 for e in self._tails.values() if e.kind == KIND_SEQ)

    def _bound_for(self, e: Entry) -> OrderedDict | None:
        if e.kind == KIND_BLOCK:
            return None
        return self._checkpoints if e.kind == KIND_BOUNDARY else self._tails

    # ------------------------------------------------------------------ updates
    def put(self, e: Entry, pin: bool = False) -> bool:
        """Insert or replace an entry; evict to stay under the budget and count bounds.

        Returns False (and stores nothing) when the entry alone exceeds the budget or a
        count bound of 0 disables its kind.
        """
        bounded = self._bound_for(e)
        limit = (
            None
            if bounded is None
            else (self.max_checkpoints if bounded is self._checkpoints else self.max_tails)
        )
        if e.nbytes > self.max_bytes or limit == 0:
            return False
        self.remove(e.id)
        self._entries[e.id] = e
        self._lru.setdefault(e.priority, OrderedDict())[e.id] = e
        self.nbytes += e.nbytes
        self.snapshot_count += bool(e.snapshot_nbytes)
        self.snapshot_nbytes += e.snapshot_nbytes
        if e.kind != KIND_BLOCK:
            self.tail_nbytes += e.nbytes
        if pin:
            self.pinned.add(e.id)
        self.children.setdefault(e.parent, set()).add(e.id)
        if bounded is not None:
            bounded[e.id] = e
            while len(bounded) > limit:
                victim = next(iter(bounded.values()))
                self._evict(victim, "count")
        self.shrink_to(self.max_bytes, keep=e.id)
        return True

    def remove(self, entry_id: str) -> Entry | None:
        e = self._entries.pop(entry_id, None)
        if e is None:
            return None
        self._lru[e.priority].pop(entry_id, None)
        bounded = self._bound_for(e)
        if bounded is not None:
            bounded.pop(entry_id, None)
        ids = self.children.get(e.parent)
        if ids is not None:
            ids.discard(entry_id)
            if not ids:
                del self.children[e.parent]
        self.pinned.discard(entry_id)
        self.nbytes -= e.nbytes
        self.snapshot_count -= bool(e.snapshot_nbytes)
        self.snapshot_nbytes -= e.snapshot_nbytes
        if e.kind != KIND_BLOCK:
            self.tail_nbytes -= e.nbytes
        return e

    def _evict(self, e: Entry, why: str) -> None:
        self.remove(e.id)
        if e.kind == KIND_BLOCK:
            self.evictions += 1
        else:
            self.tail_evictions += 1
        self._on_evict(e, why)

    def reserve(self, nbytes: int) -> int:
        """Hold ``nbytes`` of the budget for the resident cache; evicts to make room and
        returns the number of entries evicted."""
        self.reserved = nbytes
        return self.shrink_to(self.max_bytes)

    def shrink_to(self, max_bytes: int, keep: str | None = None) -> int:
        """Evict lowest priority first, LRU inside, until ``nbytes + reserved <= max_bytes``.

        Pinned entries and ``keep`` stay. Returns the number of entries evicted.
        """
        n = 0
        for prio in sorted(self._lru):
            lru = self._lru[prio]
            for entry_id in list(lru):
                if self.nbytes + self.reserved <= max_bytes:
                    return n
                if entry_id in self.pinned or entry_id == keep:
                    continue
                self._evict(lru[entry_id], "budget")
                n += 1
        return n

    def set_budget(self, max_bytes: int) -> int:
        """Change the byte budget (memory pressure); evicts as needed, returns evictions."""
        self.max_bytes = max_bytes
        return self.shrink_to(max_bytes)

    def clear(self, tails_only: bool = False) -> int:
        victims = [e for e in self._entries.values() if not tails_only or e.kind != KIND_BLOCK]
        for e in victims:
            self.remove(e.id)
        return len(victims)
