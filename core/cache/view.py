"""What the planner and the capture see of the prefix cache (docs/DESIGN.md §9).

:class:`TierView` is the read side: the layout (block size, root id, leaves by kind) and
where each entry is held, over the hot and SSD tiers together. :class:`CaptureView` adds
the three writes a capture makes. :class:`~.prefix.PrefixCache` is both; the planner's
unit test fills a small one by hand, with no model and no arrays. As vLLM's
``KVCacheBlocks`` hides its manager's data structure from the scheduler, a view hides the
tiers: nothing behind it names ``hot`` or ``ssd``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .blocks import Entry, EntryMeta
from .layers import Leaf
from .plans import Held


class TierView(Protocol):
    """The prefix cache as :class:`~.planner.Planner` reads it.

    ``block_size``: tokens a block; ``root``: the chain's root id (its first block's
    parent); ``leaves``: every cache leaf, and ``state`` those that keep snapshots (empty:
    none); ``exact_prefix``: restores may stop at the exact common prefix (the folded
    schedule, docs/DESIGN.md §7); ``logprobs_spec``: ``((vocab,), dtype)`` of the
    first-token logprobs a prompt tail may keep, or None.
    """

    block_size: int
    root: str
    leaves: Sequence[Leaf]
    state: Sequence[Leaf]
    exact_prefix: bool
    logprobs_spec: tuple[tuple[int, ...], Any] | None

    def held(self, entry_id: str, use_ssd: bool = True) -> Held | None:
        """Where ``entry_id`` is held (hot first, then SSD) and what it carries, or None."""
        ...

    def children(self, parent: str, use_ssd: bool = True) -> Sequence[EntryMeta]:
        """The entries that follow ``parent`` (a hot ``Entry`` where both tiers hold one)."""
        ...

    def find(self, entry_id: str, use_ssd: bool = True) -> EntryMeta | None:
        """The entry ``entry_id`` as a tier holds it (hot first, then SSD), or None."""
        ...


class CaptureView(TierView, Protocol):
    """The prefix cache as :class:`~.capture.Capture` uses it: :class:`TierView`, the
    leaves by kind (``kv``, ``window``), and the writes a capture makes."""

    kv: Sequence[Leaf]
    window: Sequence[Leaf]

    def hot_entry(self, entry_id: str, touch: bool = False) -> Entry | None:
        """The hot tier's entry ``entry_id`` (``touch``: as a use, in LRU order), or None."""
        ...

    def repair(self, e: Entry) -> None:
        """A hot entry captured again: offered to the SSD tier again."""
        ...

    def commit(self, entries: list[Entry]) -> None:
        """Put evaluated entries into the tiers."""
        ...
