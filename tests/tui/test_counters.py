"""The cache panels and the Events log read truthfully, through the real engine on
``tiny:llama``: after a cold turn, a resident hit, a hit through a prompt tail and a model
load (F4). The hit rate counts every kind of hit (one per turn, not per block), the Events
log shows the cold turn as a miss and starts afresh with the new model's cache, and the
per-turn labels name the tier and kind the tokens came from.

Skipped cleanly while ``tierchat.core.engine.engine`` (or MLX) cannot be imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import RichLog, Static
from tui_kit import REAL_TIMEOUT_S, chat_screen, real_app, real_settings, send, settle

pytest.importorskip("tierchat.core.engine.engine")

pytestmark = [pytest.mark.anyio, pytest.mark.slow]



@pytest.fixture
def settings(tmp_path: Path):
    return real_settings(tmp_path, max_tokens=6)


def panel_text(screen, selector: str) -> str:
    return str(screen.query_one(selector, Static).render())


def events_text(screen) -> str:
    return "\n".join(line.text for line in screen.query_one("#events-log", RichLog).lines)


async def test_panels_and_events_after_cold_resident_tail_and_f4(settings):
    from tierchat.tui.widgets.cache_panels import CachePanels

    async with real_app(settings, size=(160, 60)) as (app, pilot, engine, store):
        screen = chat_screen(app)
        panels = screen.query_one(CachePanels)

        async def refreshed():
            screen.app.poll_stats()
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            return panels.stats

        # -- a cold turn: a miss, in the Hits panel and in the Events log
        await send(pilot, "A first question for the tiny model, long enough for blocks.")
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        stats = await refreshed()
        assert stats.lookups.cold == 1 and stats.lookups.hits == 0
        assert panel_text(screen, "#hits-rate") == "hit rate 0% (0/1 turns) · cold 1"
        assert "miss: nothing cached for" in events_text(screen)
        first_cid = screen.conversation_id

        # -- the same prompt again: the resident cache, RAM (hot), kind resident
        await pilot.press("ctrl+r")
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        stats = await refreshed()
        lt = stats.last_turn
        assert lt.cached_kind["resident"] == lt.prompt_tokens == lt.cached_by["hot"]
        assert stats.lookups.resident == 1
        assert panel_text(screen, "#hits-rate") == "hit rate 50% (1/2 turns) · cold 1"
        assert panel_text(screen, "#hits-split").startswith("resident 1 · hot 0 · SSD 0")
        # the Hot panel no longer counts a miss per block the resident turn skipped
        assert "misses" not in panel_text(screen, "#hot-counters")

        # -- another conversation takes the resident cache; back in the first one, a
        #    regenerate of its reply comes from hot blocks and the prompt's tail
        await pilot.press("ctrl+n")
        await send(pilot, "Something else entirely, about the weather in spring.")
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        screen.open_conversation(first_cid)
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        await pilot.press("ctrl+r")
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        stats = await refreshed()
        lt = stats.last_turn
        assert lt.cached_kind["tail"] > 0 and lt.cached_kind["resident"] == 0, lt
        assert lt.cached_by["hot"] == lt.cached_tokens, lt
        lk = stats.lookups
        assert lk.tail >= 1 and lk.hot >= 1, lk
        assert lk.hits == lk.lookups - lk.cold
        rate = f"hit rate {lk.hit_rate:.0%} ({lk.hits}/{lk.lookups} turns) · cold {lk.cold}"
        assert panel_text(screen, "#hits-rate") == rate
        held, used = stats.tails.checkpoints, stats.tails.checkpoint_hits
        assert f"checkpoints held {held} · used {used}×" == panel_text(
            screen, "#checkpoints-text"
        )
        assert "hit " in events_text(screen)

        # -- F4 loads the model again: a new cache, its counters and events restart
        await pilot.press("f4")
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        picker = app.screen
        picker.query_one("#model-path").focus()
        await pilot.press(*"tiny:llama", "enter")
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        stats = await refreshed()
        assert stats.lookups.lookups == 0
        assert panel_text(screen, "#hits-rate") == "no turn yet"
        log = events_text(screen)
        assert "miss: nothing cached" not in log and "hit " not in log, log
