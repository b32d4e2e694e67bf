"""Issue 40: events logged while the cache panels are folded (under 140 columns) wrap to
the Events panel's width once it shows, as events logged while it shows do."""

from __future__ import annotations

import pytest
from textual.widgets import RichLog
from tui_kit import SIZE, WIDE, chat_screen, send, settle, wait_for

pytestmark = pytest.mark.anyio


def shown_lines(app) -> list[str]:
    log = chat_screen(app).query_one("#events-log", RichLog)
    return [strip.text.rstrip() for strip in log.lines]


async def test_events_logged_while_folded_wrap_to_the_panel_once_shown(make_app, engine):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = chat_screen(app)
        await send(pilot, "first while folded")
        await send(pilot, "second while folded")
        screen.app.poll_stats()
        events = [text for _, text in engine.stats().events]
        assert events and not screen.panels_visible
        await pilot.resize_terminal(*WIDE)  # the panels unfold
        await wait_for(pilot, lambda: screen.panels_visible, what="the panels")
        await settle(pilot)
        log = screen.query_one("#events-log", RichLog)
        width = log.scrollable_content_region.width
        assert width > 20
        await wait_for(pilot, lambda: shown_lines(app), what="the events")
        lines = shown_lines(app)
        assert all(len(line) <= width for line in lines)
        assert max(len(line) for line in lines) > width // 2  # wrapped, not a column
        text = " ".join(lines)
        for event in events:
            assert " ".join(event.split()) in " ".join(text.split())

        await pilot.press("f2")  # folded by hand: events keep coming, and show once unfolded
        await wait_for(pilot, lambda: not screen.panels_visible, what="the fold")
        await send(pilot, "third while hidden by F2")
        screen.app.poll_stats()
        await pilot.press("f2")
        await settle(pilot)
        last = engine.stats().events[-1][1]
        joined = " ".join(" ".join(shown_lines(app)).split())
        assert " ".join(last.split()) in joined
        assert all(len(line) <= width for line in shown_lines(app))
