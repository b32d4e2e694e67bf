"""The live token count through the real engine on ``tiny:llama``: the count the input's
border shows is the prompt length the engine then reports for that message, and the
context is the model's (``max_position_embeddings``). No MLX in the count itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.clock import MockClock
from tierchat.config.settings import Settings
from tierchat.core.chat.store import ConversationStore
from tierchat.tui.draft_meter import DEBOUNCE_S
from tierchat.tui.widgets.chat_input import ChatInput
from tui_kit import chat_screen, fixed_clock, settle

engine_module = pytest.importorskip("tierchat.core.engine.engine")

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

REAL_TIMEOUT_S = 180.0


async def test_the_token_count_is_the_prompt_the_engine_reads(tmp_path: Path):
    from tierchat.tui.app import TierchatApp

    settings = Settings(
        model="tiny:llama",
        data_dir=tmp_path / "data",
        cache_dir=tmp_path / "kv",
        models_dir=tmp_path / "models",
        block_size=16,
        max_tokens=4,
    )
    engine = engine_module.Engine(settings)
    store = ConversationStore(":memory:", clock=fixed_clock)
    app = TierchatApp(engine, store, settings, clock=MockClock(0.0))
    app.animation_level = "none"
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            screen = chat_screen(app)
            box = screen.query_one(ChatInput)
            box.focus()
            await pilot.press(*"How many tokens is this?")
            await pilot.pause(DEBOUNCE_S + 0.2)
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            count = screen.draft_meter.count
            assert count is not None and count.context_length == engine.context_length
            assert f"/ {engine.context_length:,}" in box.border_subtitle
            await pilot.press("enter")
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            assert engine.stats().last_turn.prompt_tokens == count.prompt_tokens
            # the input is empty again: no draft count; the context the chat uses, if any
            assert not box.border_subtitle or box.border_subtitle.startswith("context ")
    finally:
        engine.close()
        store.close()
