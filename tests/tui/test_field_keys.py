"""Keys land in order in the F9 fields when they reach the app together, as keys typed
while the app was busy do (a reply ending re-lists the conversations): Textual ran a
widget's own bindings (Backspace in an ``Input``) only after the key's round trip to the
widget and back up to the app, so digits typed after it landed first and were deleted:
"⌫⌫⌫⌫400" saved "00" or "0" (tui/terminal.py, ``KeyOrder``). The keys are posted to the
app in one go, before it handles any, which is what a busy event loop sees (in tmux at
80×24, typed 150 ms apart just as a reply ended, 4 of 10 tries lost a key before)."""

from __future__ import annotations

import pytest
from textual import events
from textual.widgets import Input
from tui_kit import SIZE, send, settle

pytestmark = pytest.mark.anyio


def key(name: str) -> events.Key:
    char = name if len(name) == 1 else None
    return events.Key(name, char)


@pytest.mark.parametrize(
    ("field", "typed", "want"), [("max_tokens", "400", 400), ("top_p", "0.9", 0.9)]
)
async def test_keys_that_arrive_together_land_in_order(make_app, store, field, typed, want):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hello")
        await pilot.press("f9")
        await settle(pilot)
        box = app.screen.query_one(f"#{field}", Input)
        box.focus()
        await pilot.pause()
        burst = ["backspace"] * 6 + list(typed)
        for name in burst:  # all queued before the app handles the first
            app.post_message(key(name))
        await settle(pilot)
        assert box.value == typed
        await pilot.press("ctrl+s")
        await settle(pilot)
        cid = store.list_conversations()[0].id
        assert store.conversation_settings(cid)[field] == want
