"""Two conversations generating at once through the real engine on ``tiny:llama``
(docs/DESIGN.md §16): send in A, open a new conversation B while A's reply streams, send
there; both replies end complete and stored, each equal (text and token ids, greedy) to
the same message sent alone in a fresh app.

A tiny model decodes faster than a person switches, so the engine thread is held in A's
event callback after A's first token batch until B has been submitted: the engine then
has both requests at once (the scheduler batches them, docs/DESIGN.md §20).

Skipped cleanly while ``tierchat.core.engine.engine`` (or MLX) cannot be imported.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tui_kit import (
    REAL_TIMEOUT_S,
    chat_screen,
    enter,
    real_app,
    real_settings,
    send,
    settle,
    wait_for,
)

pytest.importorskip("tierchat.core.engine.engine")

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MAX_TOKENS = 48

A_TEXT = "Tell me a long story about caches."
B_TEXT = "Now something else entirely: list some prime numbers."


def _reply(store, cid):
    path = store.active_path(cid)
    assert [n.role for n in path] == ["user", "assistant"]
    return path[-1].content, tuple(path[-1].token_ids), path[-1].meta["finish_reason"]


async def _alone(tmp_path: Path, text: str):
    settings = real_settings(tmp_path, max_tokens=MAX_TOKENS, temperature=0.0)
    async with real_app(settings) as (app, pilot, _engine, store):
        await send(pilot, text)
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        return _reply(store, chat_screen(app).conversation_id)


def hold_first_until_second(engine) -> tuple[threading.Event, list[bool]]:
    """Make the engine thread wait in the first request's callback, at its second token
    batch, until a second request is submitted. Returns the event set at that submit and
    a list that gets whether the first request was done by then."""
    from tierchat.core.api import TokenBatch

    second, first_done = threading.Event(), []
    submit, handles = engine.submit, []

    def held_submit(request, on_event=None):
        if handles:
            first_done.append(handles[0].done)
            handle = submit(request, on_event)
            second.set()
            return handle
        batches = 0

        def held(event):
            nonlocal batches
            if isinstance(event, TokenBatch):
                batches += 1
                if batches == 2:
                    second.wait(REAL_TIMEOUT_S)
            if on_event is not None:
                on_event(event)

        handles.append(submit(request, held))
        return handles[0]

    engine.submit = held_submit
    return second, first_done


async def test_two_conversations_at_once_equal_each_run_alone(tmp_path):
    settings = real_settings(tmp_path / "both", max_tokens=MAX_TOKENS, temperature=0.0)
    async with real_app(settings) as (app, pilot, engine, store):
        screen = chat_screen(app)
        second, first_done = hold_first_until_second(engine)
        await enter(pilot, A_TEXT)
        await wait_for(
            pilot,
            lambda: bool(screen.pane.turns.stream_view and screen.pane.turns.stream_view.text),
            timeout=REAL_TIMEOUT_S,
            what="A's first tokens",
        )
        a = screen.conversation_id
        await pilot.press("ctrl+n")
        await enter(pilot, B_TEXT)
        await wait_for(pilot, lambda: screen.conversation_id not in (None, a), what="B")
        b = screen.conversation_id
        await wait_for(pilot, second.is_set, timeout=REAL_TIMEOUT_S, what="B's submit")
        assert first_done == [False]  # the engine had both requests at once
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        both = _reply(store, a), _reply(store, b)
        screen.action_open_conversation(a)
        await settle(pilot, timeout=REAL_TIMEOUT_S)
        shown = [(v.info.role, v.info.content) for v in screen.query_one("Transcript").views]
        assert shown == [("user", A_TEXT), ("assistant", both[0][0])]
    alone = await _alone(tmp_path / "a", A_TEXT), await _alone(tmp_path / "b", B_TEXT)
    assert both == alone
    assert all(len(ids) > 0 for _text, ids, _why in both)
