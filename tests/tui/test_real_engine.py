"""End to end through the real engine on ``tiny:llama``: the app loads the model itself,
then send, regenerate, swipe and clear the hot tier; assert on the store and the stats.

Skipped cleanly while ``tierchat.core.engine.engine`` (or MLX) cannot be imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.clock import MockClock
from tierchat.config.settings import Settings
from tierchat.core.chat.store import ConversationStore
from tui_kit import chat_screen, fixed_clock, send, settle

engine_module = pytest.importorskip("tierchat.core.engine.engine")

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

REAL_TIMEOUT_S = 180.0


@pytest.fixture
def real_settings(tmp_path: Path) -> Settings:
    return Settings(
        model="tiny:llama",
        data_dir=tmp_path / "data",
        cache_dir=tmp_path / "kv",
        models_dir=tmp_path / "models",
        block_size=16,
        max_tokens=12,
        hot_bytes=64 << 20,
        ssd_bytes=256 << 20,
    )


async def test_tiny_llama_send_regenerate_swipe_clear_hot(real_settings):
    from tierchat.tui.app import TierchatApp
    from tierchat.tui.widgets.cache_panels import CachePanels, CacheSummary

    engine = engine_module.Engine(real_settings)
    store = ConversationStore(":memory:", clock=fixed_clock)
    app = TierchatApp(engine, store, real_settings, clock=MockClock(0.0))
    app.animation_level = "none"
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot, timeout=REAL_TIMEOUT_S)  # the app loads tiny:llama itself
            assert engine.model_name == "tiny:llama"
            screen = chat_screen(app)

            await send(pilot, "Hello, tiny model. Tell me about caches.")
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            cid = screen.conversation_id
            path = store.active_path(cid)
            assert [n.role for n in path] == ["user", "assistant"]
            first = path[-1]
            assert first.token_ids  # the generated ids are kept for splicing

            await pilot.press("ctrl+r")
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            user = store.active_path(cid)[0]
            replies = store.replies(user.id)
            assert len(replies) == 2
            assert store.active_path(cid)[-1].id == replies[1].id
            stats = engine.stats()
            # regenerate reuses the prompt: only the last token (at most a block) is new
            assert stats.last_turn.cached_tokens > 0
            assert stats.last_turn.prefill_tokens < stats.last_turn.prompt_tokens
            assert stats.hot.entries > 0

            await pilot.press("alt+left")
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            assert store.active_path(cid)[-1].id == first.id

            await pilot.press("f5", "y")
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            stats = engine.stats()
            assert stats.hot.entries == 0 and stats.hot.nbytes == 0
            # below WIDE_COLUMNS (the size here) the summary line shows the stats
            shown = CachePanels if screen.panels_visible else CacheSummary
            assert screen.query_one(shown).stats.hot.entries == 0
            assert any(n.title == "Cache cleared" for n in app._notifications)
    finally:
        engine.close()
        store.close()
