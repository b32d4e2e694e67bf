"""The verify-against-cold key on a reply, through the real engine on ``tiny:llama``:
``V`` on the selected reply recomputes it with no cache; the report shows in the reply's
row, is stored with it, and is in the events; the palette has the command."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.clock import MockClock
from textual.widgets import Static
from tierchat.config.settings import Settings
from tierchat.core.chat.store import ConversationStore
from tui_kit import chat_screen, fixed_clock, send, settle

engine_module = pytest.importorskip("tierchat.core.engine.engine")

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

REAL_TIMEOUT_S = 180.0


async def test_verify_key_reports_in_the_row_and_the_store(tmp_path: Path):
    from tierchat.tui.app import TierchatApp
    from tierchat.tui.commands import TOOL_COMMANDS
    from tierchat.tui.widgets.transcript import MessageView

    settings = Settings(
        model="tiny:llama",
        data_dir=tmp_path / "data",
        cache_dir=tmp_path / "kv",
        models_dir=tmp_path / "models",
        block_size=16,
        max_tokens=8,
        bitwise=True,
        hot_bytes=64 << 20,
        ssd_bytes=256 << 20,
    )
    assert any(c.action == "verify_turn" for c in TOOL_COMMANDS)
    engine = engine_module.Engine(settings)
    store = ConversationStore(":memory:", clock=fixed_clock)
    app = TierchatApp(engine, store, settings, clock=MockClock(0.0))
    app.animation_level = "none"
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            screen = chat_screen(app)
            await send(pilot, "Hello, tiny model. Tell me about caches.")
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            await pilot.press("alt+up")  # the message cursor, on the last message: the reply
            await pilot.pause()
            await pilot.press("V")
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            reply = store.active_path(screen.conversation_id)[-1]
            report = reply.meta.get("verify")
            assert report is not None and report["cached"]["first_diff"] is None
            row = screen.query(MessageView).last().query_one(".metrics", Static)
            assert "verify vs cold: top-1" in str(row.render())
            assert any(t.startswith("verify vs cold") for _, t in engine.stats().events)
            assert any(n.title == "Verify against cold" for n in app._notifications)
    finally:
        engine.close()
        store.close()
