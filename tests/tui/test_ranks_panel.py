"""The ranks panel (issue 20): every rank's hot and SSD fill, memory and last restore,
shown only when the engine reports more than one rank."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tierchat.core.api import RankStats
from tierchat.tui.widgets.cache_panels import CachePanels
from tierchat.tui.widgets.ranks_panel import rank_lines
from tui_kit import WIDE, FlakyEngine, chat_screen, send

pytestmark = pytest.mark.anyio

MiB = 1 << 20


class RankedEngine(FlakyEngine):
    """A fake engine whose stats carry ``ranks`` (as rank 0 of several reports them)."""

    ranks: tuple[RankStats, ...] = ()

    def stats(self):
        return replace(super().stats(), ranks=self.ranks)


def two_ranks() -> tuple[RankStats, ...]:
    return (
        RankStats(
            rank=0,
            hot_bytes=3 * MiB,
            ssd_bytes=5 * MiB,
            memory_active_bytes=200 * MiB,
            cached_hot=64,
        ),
        RankStats(
            rank=1,
            hot_bytes=2 * MiB,
            ssd_bytes=5 * MiB,
            memory_active_bytes=180 * MiB,
            memory_level="soft",
            cached_hot=64,
        ),
    )


async def test_ranks_panel_shows_every_rank(make_app):
    engine = RankedEngine("demo")
    engine.ranks = two_ranks()
    app = make_app(engine=engine)
    async with app.run_test(size=WIDE) as pilot:
        await send(pilot, "hello across ranks")
        panel = chat_screen(app).query_one(CachePanels).query_one("#ranks-panel")
        assert panel.display and panel.has_class("-ranks")
        assert panel.border_title == "Ranks (2)"
        text = str(panel.query_one("#ranks-text").content)
        assert "r0 hot 3.0 MiB · SSD 5.0 MiB" in text
        assert "r1 hot 2.0 MiB" in text and "180.0 MiB soft" in text
        assert "last restore, all ranks: hot 64 · ssd 0" in text
        assert panel.has_class("-pressure")  # rank 1 is at soft pressure
    engine.close()


async def test_ranks_panel_is_hidden_on_one_rank(make_app):
    engine = RankedEngine("demo")
    app = make_app(engine=engine)
    async with app.run_test(size=WIDE) as pilot:
        await send(pilot, "hello")
        panel = chat_screen(app).query_one(CachePanels).query_one("#ranks-panel")
        assert not panel.has_class("-ranks")
        assert not panel.display or panel.styles.display == "none"
    engine.close()


def test_many_ranks_fold_into_min_max_with_the_rank_named():
    ranks = tuple(
        RankStats(
            rank=i,
            hot_bytes=(i + 1) * MiB,
            ssd_bytes=MiB,
            cached_ssd=32,
            memory_level="hard" if i == 4 else "ok",
            memory_active_bytes=100 * MiB,
        )
        for i in range(6)
    )
    lines = rank_lines(ranks)
    assert lines[0] == "hot min 1.0 MiB (r0) · max 6.0 MiB (r5)"
    assert lines[2] == "memory worst r4: hard, 100.0 MiB active"
    assert lines[3] == "last restore, all ranks: hot 0 · ssd 32"
    ranks = (*ranks[:5], replace(ranks[5], cached_ssd=0))
    assert rank_lines(ranks)[-1] == "last restore differs between ranks"
