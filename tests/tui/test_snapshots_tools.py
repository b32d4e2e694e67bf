"""``snap_compare`` snapshots of the views screens/chat/tools.py adds: the search results
(across conversations, matched words in bold) and a message's raw text.

Regenerate with ``pytest tests/tui/test_snapshots_tools.py --snapshot-update`` and look
at them (``tests/tui/__snapshots__/test_snapshots_tools/``) before committing.
"""

from __future__ import annotations

from test_chat_tools import USER_TEXT, old_chat
from test_snapshots import SNAP_SIZE, quiet
from textual.widgets import Input
from tierchat.tui.widgets.transcript import Transcript
from tui_kit import chat_screen, send


def test_search_results(snap_compare, make_app, store):
    old_chat(store, "Trip notes", 3, word_at=1)
    old_chat(store, "Packing list", 2, word_at=0)

    async def run_before(pilot):
        await quiet(pilot)
        await pilot.press("ctrl+f")
        pilot.app.screen.query_one(Input).value = "zanzibar quest"
        await pilot.press("ctrl+t")  # all conversations: two hits, with their titles
        await quiet(pilot)

    assert snap_compare(make_app(), terminal_size=SNAP_SIZE, run_before=run_before)


def test_raw_message_view(snap_compare, make_app):
    async def run_before(pilot):
        await send(pilot, USER_TEXT)
        screen = chat_screen(pilot.app)
        screen.query_one(Transcript).focus()
        await pilot.pause()
        screen.pane.selected = 0
        await pilot.press("v")
        await quiet(pilot)

    assert snap_compare(make_app(), terminal_size=SNAP_SIZE, run_before=run_before)
