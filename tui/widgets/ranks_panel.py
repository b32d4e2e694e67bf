"""The ranks panel: every rank's hot and SSD fill, memory and last restore, when one model
runs across several ranks (docs/DESIGN.md §19). Hidden when it runs alone (``CacheStats.ranks`` is
empty). Up to :data:`MAX_ROWS` ranks get a line each; beyond, the smallest and largest
fill with the rank that has it, and the rank with the worst memory pressure.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Static
from tierchat.core.api import CacheStats, RankStats
from tierchat.core.units import fmt_bytes, fmt_count
from tierchat.tui.widgets.cache_panels import Panel

MAX_ROWS = 4
_LEVEL_ORDER = {"ok": 0, "soft": 1, "hard": 2}


def rank_line(r: RankStats) -> str:
    """One rank in two lines of the panel's width::

    r1 hot 1.2 MiB · SSD 3.4 MiB
       mem 2.0 GiB ok · restored hot 64
    """
    restored = f"hot {fmt_count(r.cached_hot)}" if r.cached_hot else ""
    if r.cached_ssd:
        restored += f"{' ' if restored else ''}ssd {fmt_count(r.cached_ssd)}"
    return (
        f"r{r.rank} hot {fmt_bytes(r.hot_bytes)} · SSD {fmt_bytes(r.ssd_bytes)}\n"
        f"   mem {fmt_bytes(r.memory_active_bytes)} {r.memory_level}"
        + (f" · restored {restored}" if restored else "")
    )


def spread(ranks: tuple[RankStats, ...], field: str) -> str:
    """``min 1.0 MiB (r1) · max 1.2 MiB (r0)`` of a byte field over the ranks."""
    lo = min(ranks, key=lambda r: (getattr(r, field), r.rank))
    hi = max(ranks, key=lambda r: (getattr(r, field), -r.rank))
    return (
        f"min {fmt_bytes(getattr(lo, field))} (r{lo.rank}) · "
        f"max {fmt_bytes(getattr(hi, field))} (r{hi.rank})"
    )


def rank_lines(ranks: tuple[RankStats, ...]) -> list[str]:
    """The panel's lines for ``ranks`` (rank 0 first)."""
    if len(ranks) <= MAX_ROWS:
        lines = [rank_line(r) for r in ranks]
    else:
        worst = max(
            ranks, key=lambda r: (_LEVEL_ORDER.get(r.memory_level, 0), r.memory_active_bytes)
        )
        lines = [
            f"hot {spread(ranks, 'hot_bytes')}",
            f"SSD {spread(ranks, 'ssd_bytes')}",
            f"memory worst r{worst.rank}: {worst.memory_level}, "
            f"{fmt_bytes(worst.memory_active_bytes)} active",
        ]
    restores = {(r.cached_hot, r.cached_ssd) for r in ranks}
    if len(restores) == 1:
        hot, ssd = restores.pop()
        lines.append(f"last restore, all ranks: hot {fmt_count(hot)} · ssd {fmt_count(ssd)}")
    else:
        lines.append("last restore differs between ranks")
    return lines


class RanksPanel(Panel):
    """Every rank's cache and memory (see the module doc)."""

    TITLE = "Ranks"
    DEFAULT_CSS = """
    RanksPanel { display: none; }
    RanksPanel.-ranks { display: block; }
    RanksPanel.-pressure { border: round $warning; }
    """

    def compose(self) -> ComposeResult:
        yield Static("", id="ranks-text", markup=False)

    def show(self, stats: CacheStats) -> None:
        ranks = tuple(getattr(stats, "ranks", ()) or ())
        self.set_class(bool(ranks), "-ranks")
        if not ranks:
            return
        self.border_title = f"Ranks ({len(ranks)})"
        self.border_subtitle = "one cache per rank"
        self.set_class(any(r.memory_level != "ok" for r in ranks), "-pressure")
        self.query_one("#ranks-text", Static).update("\n".join(rank_lines(ranks)))
