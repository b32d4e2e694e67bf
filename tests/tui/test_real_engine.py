"""End to end through the real engine on ``tiny:llama``: the app loads the model itself,
then send, regenerate, swipe and clear the hot tier; assert on the store and the stats.

Skipped cleanly while ``tierchat.core.engine.engine`` (or MLX) cannot be imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tui_kit import REAL_TIMEOUT_S, chat_screen, real_app, real_settings, send, settle

pytest.importorskip("tierchat.core.engine.engine")

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def settings(tmp_path: Path):
    return real_settings(tmp_path, max_tokens=12)


async def test_tiny_llama_send_regenerate_swipe_clear_hot(settings):
    from tierchat.tui.widgets.cache_panels import CachePanels

    async with real_app(settings, size=(150, 40)) as (app, pilot, engine, store):
        assert engine.model_name == "tiny:llama"
        screen = chat_screen(app)
        # the header's device line is the loaded model's (ModelInfo; the TUI imports no MLX)
        assert engine.info.device_line.startswith("cpu") and "float32" in engine.info.device_line
        assert f"tiny:llama ({engine.info.device_line})" in screen.sub_title

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
        assert screen.query_one(CachePanels).stats.hot.entries == 0
        assert any(n.title == "Cache cleared" for n in app._notifications)
