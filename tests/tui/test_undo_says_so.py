"""Issue 40: ``u`` with nothing to undo says so instead of doing nothing."""

from __future__ import annotations

import pytest
from tui_kit import SIZE, chat_screen, send, settle

pytestmark = pytest.mark.anyio


def notes(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


async def test_u_with_nothing_to_undo_says_so(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hello")
        nodes = len(store.active_path(chat_screen(app).conversation_id))
        await pilot.press("escape", "u")  # the message cursor, then undo
        await settle(pilot)
        assert any("Nothing to undo" in n for n in notes(app))
        assert len(store.active_path(chat_screen(app).conversation_id)) == nodes
        await pilot.press("d", "y")  # delete the reply, then undo puts it back
        await settle(pilot)
        assert len(store.active_path(chat_screen(app).conversation_id)) == nodes - 1
        await pilot.press("u")
        await settle(pilot)
        assert len(store.active_path(chat_screen(app).conversation_id)) == nodes
