"""The prefix cache's figures as the stats snapshot carries them (docs/DESIGN.md §10):
one immutable record per tier, read from a :class:`~.prefix.PrefixCache` on any thread."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..api import ResidentStats, SnapshotStats, TailStats, TierStats, WearStats

if TYPE_CHECKING:
    from .prefix import PrefixCache


@dataclass
class HitCounters:
    """The prefix cache's hit, miss and error counters since start, moved by its restores
    (:class:`~.restore.Restorer`) and its commits (``tail_stashes``), read into the
    figures below."""

    hot_hits: int = 0
    hot_misses: int = 0
    resident_hits: int = 0
    tail_stashes: int = 0
    tail_hits: int = 0
    tail_misses: int = 0
    tail_tokens_saved: int = 0
    checkpoint_hits: int = 0
    restore_errors: int = 0


def tier_stats(
    cache: PrefixCache,
) -> tuple[TierStats, TierStats, TailStats, SnapshotStats, ResidentStats]:
    """The hot tier, the SSD tier (``enabled=False`` without one), the tails and
    checkpoints, the state snapshots and the resident cache of ``cache``."""
    hot, counts = cache.hot, cache.counts
    hot_stats = TierStats(
        entries=len(hot),
        nbytes=hot.nbytes,
        max_bytes=hot.max_bytes,
        hits=counts.hot_hits,
        misses=counts.hot_misses,
        evictions=hot.evictions,
        errors=counts.restore_errors,
    )
    s = cache.ssd
    if s is None:
        ssd_stats = TierStats(enabled=False, reason="SSD tier off")
    else:
        s.reconcile()  # files removed behind the tier's back leave the figures
        ssd_stats = TierStats(
            entries=len(s),
            nbytes=s.nbytes,
            max_bytes=s.max_bytes,
            hits=s.hits,
            misses=s.misses,
            evictions=s.evictions,
            evicted_bytes=s.evicted_bytes,
            saves_queued=s.saves_queued,
            saves_persisted=s.saves_persisted,
            write_drops=s.write_drops,
            errors=s.errors,
            corrupt=s.corrupt,
            queue_depth=s.queue_depth,
            enabled=s.enabled,
            reason=s.reason,
        )
    tails = TailStats(
        entries=hot.n_tails,
        max_entries=hot.max_tails,
        nbytes=hot.tail_nbytes,
        stashes=counts.tail_stashes,
        hits=counts.tail_hits,
        misses=counts.tail_misses,
        evictions=hot.tail_evictions,
        tokens_saved=counts.tail_tokens_saved,
        # sequence ends and boundaries: what a turn's "checkpoint" tokens came from
        checkpoints=hot.n_checkpoints + hot.n_seq,
        checkpoint_hits=counts.checkpoint_hits,
        supported=True,
    )
    snaps = SnapshotStats(count=hot.snapshot_count, nbytes=hot.snapshot_nbytes)
    r = cache.resident
    resident = ResidentStats(
        tokens=len(r.tokens) if r else 0, nbytes=r.nbytes if r else 0, hits=counts.resident_hits
    )
    return hot_stats, ssd_stats, tails, snaps, resident


# the hit and miss counters a restore moves (a measurement's restore puts them back)
_COUNTERS = (
    "hot_hits",
    "hot_misses",
    "resident_hits",
    "tail_hits",
    "tail_misses",
    "tail_tokens_saved",
    "checkpoint_hits",
)


@contextmanager
def uncounted(cache: PrefixCache) -> Iterator[None]:
    """Hits and misses of ``cache``'s tiers, tails, checkpoints and resident cache as they
    were before the block: a measurement's restore (:class:`~.request.MeasureRequest`)
    counts nowhere. A snapshot taken meanwhile on another thread may see them moved for
    the time of that restore."""
    counts = cache.counts
    saved = {k: getattr(counts, k) for k in _COUNTERS}
    ssd = cache.ssd
    ssd_saved = (ssd.hits, ssd.misses) if ssd is not None else (0, 0)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(counts, k, v)
        if ssd is not None:
            ssd.hits, ssd.misses = ssd_saved


def wear_stats(cache: PrefixCache) -> WearStats:
    """Of ``cache``: SSD bytes written and what admission deferred or skipped (docs/DESIGN.md §8.6)."""
    s, w = cache.ssd, cache.writes
    if s is None:
        return WearStats(enabled=False)
    led = s.ledger
    return WearStats(
        session_bytes=led.session_bytes,
        session_files=led.session_files,
        total_bytes=led.total_bytes,
        total_files=led.total_files,
        day_bytes=led.day_bytes(),
        budget_bytes=led.budget,
        pending_bytes=s.pending_bytes,
        deferred=w.deferred,
        deferred_bytes=w.deferred_bytes,
        skipped=w.skipped,
        skipped_bytes=w.skipped_bytes,
        budget_skips=s.budget_skips,
        budget_skipped_bytes=s.budget_skipped_bytes,
    )
