"""Every cache panel's text fits the panel at every terminal size from 80×24 up: at large
figures (GiB, tens of thousands of turns, a 24 h write budget) no line of a panel is wider
than the panel's content, so nothing is cut at the fixed width (fake engine, Pilot)."""

from __future__ import annotations

import pytest
from rich.cells import cell_len
from textual.widgets import DataTable, Static
from tierchat.core.api import (
    CacheStats,
    LookupStats,
    MemoryStats,
    ResidentStats,
    SnapshotStats,
    TailStats,
    TierStats,
    TurnMetrics,
    WearStats,
)
from tierchat.tui.widgets.cache_panels import CachePanels, Panel, fit_parts
from tui_kit import chat_screen, settle, wait_for

pytestmark = pytest.mark.anyio

GiB = 1 << 30


def big_stats() -> CacheStats:
    """Figures as a long day on a large machine gives them."""
    return CacheStats(
        model="mlx-community/Qwen3-Coder-30B-A3B-Instruct-4bit",
        block_size=256,
        enabled=True,
        supported=True,
        hot=TierStats(entries=123_456, nbytes=99 * GiB, max_bytes=128 * GiB, hits=987_654,
                      misses=65_432, evictions=43_210),
        ssd=TierStats(entries=99_999, nbytes=999 * GiB, max_bytes=1000 * GiB, hits=99_999,
                      misses=9_999, queue_depth=64, errors=12, write_drops=345, corrupt=7),
        wear=WearStats(session_bytes=999 * GiB, total_bytes=1000 * 1024 * GiB,
                       day_bytes=999 * GiB, budget_bytes=1000 * GiB, deferred=12_345,
                       deferred_bytes=3 * GiB, skipped=23_456, skipped_bytes=456 * GiB,
                       budget_skips=34_567),
        tails=TailStats(entries=1_234, max_entries=4_096, nbytes=12 * GiB, hits=54_321,
                        misses=12_345, evictions=98_765, tokens_saved=12_345_678,
                        checkpoints=4_321, checkpoint_hits=54_321, supported=True),
        snapshots=SnapshotStats(count=123_456, nbytes=99 * GiB),
        resident=ResidentStats(tokens=262_144, nbytes=99 * GiB, hits=54_321),
        lookups=LookupStats(resident=54_321, hot=43_210, ssd=32_109, cold=21_098, tail=10_987),
        memory=MemoryStats(active=99 * GiB, cache=88 * GiB, peak=111 * GiB, limit=115 * GiB,
                           level="soft"),
        last_turn=TurnMetrics(
            prompt_tokens=262_144, cached_tokens=262_080,
            cached_by={"hot": 131_072, "ssd": 131_008},
            cached_kind={"block": 261_888, "tail": 64, "checkpoint": 128},
            prefill_tokens=64, ttft_s=12.345, prefill_tps=12_345.6, generation_tps=123.4,
        ),
        events=((1, "hit 262,080 tokens: hot 131,072, ssd 131,008"),),
    )  # fmt: skip


def test_fit_parts_breaks_between_parts_only():
    assert fit_parts(["ab", "cd"], 10) == "ab · cd"
    assert fit_parts(["abc", "def", "gh"], 9) == "abc · def\ngh"
    assert fit_parts(["a long part", "b"], 4) == "a long part\nb"  # left whole
    assert fit_parts(["", "x", ""], 5) == "x"


@pytest.mark.parametrize("size", [(80, 24), (100, 30), (140, 40), (200, 50)])
async def test_every_panel_line_fits_its_panel(make_app, engine, monkeypatch, size):
    stats = big_stats()
    monkeypatch.setattr(engine, "stats", lambda: stats)  # every poll reads these figures
    app = make_app()
    async with app.run_test(size=size) as pilot:
        screen = chat_screen(app)
        await settle(pilot)
        if not screen.panels_visible:
            await pilot.press("f2")
            await wait_for(pilot, lambda: screen.panels_visible, what="the panels")
        panels = screen.query_one(CachePanels)
        for _ in range(3):  # laid out, then shown again at the laid-out width
            app.poll_stats()
            await pilot.pause()
        checked = 0
        for panel in panels.query(Panel):
            for static in panel.query(Static):
                if not static.display or not static.parent.display:
                    continue
                width = static.content_region.width
                text = str(static.render())
                if not text.strip() or width <= 0:
                    continue
                for line in text.split("\n"):
                    assert cell_len(line) <= width, (type(panel).__name__, line, width)
                checked += 1
            for table in panel.query(DataTable):
                assert table.virtual_size.width <= table.content_region.width, (
                    table.virtual_size,
                    table.content_region,
                )
        assert checked >= 12
        wear = str(panels.query_one("#ssd-writes", Static).render())
        assert "over budget 34,567" in wear and "24 h 999.0 GiB of 1000.0 GiB" in wear
        assert "checkpoint 128" in str(panels.query_one("#last-turn-kind", Static).render())
