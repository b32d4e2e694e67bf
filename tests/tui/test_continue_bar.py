"""A reply cut at max tokens offers continue on its branch bar; clicking it grows the reply
in place (one swipe), and the bar of a reply that ended offers none (fake engine)."""

from __future__ import annotations

import pytest
from tierchat.tui.widgets.transcript import BranchBar, Transcript
from tui_kit import SIZE, chat_screen, send, settle

pytestmark = pytest.mark.anyio

LONG = "a question long enough that the fake reply runs past sixty-four tokens " * 2


def bar_text(app, index: int = -1) -> str:
    view = chat_screen(app).query_one(Transcript).views[index]
    return str(view.query_one(BranchBar).render())


async def test_a_cut_reply_offers_continue_and_it_grows_in_place(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "short one")
        assert "continue" not in bar_text(app)
        screen = chat_screen(app)
        session = screen.tierchat.session
        session.save_settings(
            session.settings(screen.conversation_id).with_values({"max_tokens": 8})
        )
        await send(pilot, LONG)
        cut = store.active_path(screen.conversation_id)[-1]
        assert cut.meta["finish_reason"] == "length"
        assert "⏵ continue" in bar_text(app)
        view = screen.query_one(Transcript).views[-1]
        view.query_one(BranchBar).action_branch("continue")
        await settle(pilot)
        grown = store.active_path(screen.conversation_id)[-1]
        assert grown.id == cut.id and grown.meta["continued"] == 1
        assert len(grown.token_ids) > len(cut.token_ids)
        assert len(store.replies(cut.parent_id)) == 1
        assert "1/1" in bar_text(app)
