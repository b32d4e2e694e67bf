"""The live token count through the real engine on ``tiny:llama``: the count the input's
border shows is the prompt length the engine then reports for that message, and the
context is the model's (``max_position_embeddings``). No MLX in the count itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tierchat.tui.draft_meter import DEBOUNCE_S
from tierchat.tui.widgets.chat_input import ChatInput
from tui_kit import REAL_TIMEOUT_S, chat_screen, real_app, real_settings, settle

pytest.importorskip("tierchat.core.engine.engine")

pytestmark = [pytest.mark.anyio, pytest.mark.slow]



async def test_the_token_count_is_the_prompt_the_engine_reads(tmp_path: Path):

    settings = real_settings(tmp_path, max_tokens=4)
    async with real_app(settings, size=(150, 40)) as (app, pilot, engine, store):
        screen = chat_screen(app)
        box = screen.query_one(ChatInput)
        box.focus()
        await pilot.press(*"How many tokens is this?")
        await pilot.pause(DEBOUNCE_S + 0.2)
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        count = screen.pane.draft_meter.count
        assert count is not None and count.context_length == engine.context_length
        assert f"/ {engine.context_length:,}" in box.border_subtitle
        await pilot.press("enter")
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        assert engine.stats().last_turn.prompt_tokens == count.prompt_tokens
        # the input is empty again: no draft count; the context the chat uses, if any
        assert not box.border_subtitle or box.border_subtitle.startswith("context ")
