"""The verify-against-cold key on a reply, through the real engine on ``tiny:llama``:
``V`` on the selected reply recomputes it with no cache; the report shows in the reply's
row, is stored with it, and is in the events; the palette has the command."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Static
from tui_kit import REAL_TIMEOUT_S, chat_screen, real_app, real_settings, send, settle

pytest.importorskip("tierchat.core.engine.engine")

pytestmark = [pytest.mark.anyio, pytest.mark.slow]



async def test_verify_key_reports_in_the_row_and_the_store(tmp_path: Path):
    from tierchat.tui.commands import TOOL_COMMANDS
    from tierchat.tui.widgets.transcript import MessageView

    settings = real_settings(tmp_path, bitwise=True)
    assert any(c.action == "verify_turn" for c in TOOL_COMMANDS)
    async with real_app(settings, size=(150, 40)) as (app, pilot, engine, store):
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
