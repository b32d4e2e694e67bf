"""``snap_compare`` snapshots of the app's main states, at an explicit terminal size.

Regenerate the baselines with ``pytest tests/tui --snapshot-update`` and look at them
(``tests/tui/__snapshots__/``) before committing.
"""

from __future__ import annotations

import pytest
from tui_kit import FlakyEngine, chat_screen, send, settle

SNAP_SIZE = (140, 44)


async def quiet(pilot) -> None:
    """Settle and drop the toasts earlier steps raised (each snapshot shows its own)."""
    await settle(pilot)
    pilot.app.clear_notifications()
    await pilot.pause()


def test_empty_app(snap_compare, make_app):
    assert snap_compare(make_app(), terminal_size=SNAP_SIZE, run_before=quiet)


def test_three_way_swipe(snap_compare, make_app):
    async def run_before(pilot):
        await send(pilot, "Explain prefix caching in **two** sentences.")
        await pilot.press("ctrl+r")
        await settle(pilot)
        await pilot.press("ctrl+r")
        await settle(pilot)
        await pilot.press("alt+left")  # show reply 2 of 3
        await quiet(pilot)

    assert snap_compare(make_app(), terminal_size=SNAP_SIZE, run_before=run_before)


def test_panels_after_cache_hits(snap_compare, make_app):
    async def run_before(pilot):
        await send(pilot, "What is a KV cache? Answer in one line.")
        await send(pilot, "And a prefix cache?")
        await pilot.press("ctrl+r")
        await quiet(pilot)
        stats = chat_screen(pilot.app).query_one("CachePanels").stats
        assert stats.hot.hits and stats.tails.hits

    assert snap_compare(make_app(), terminal_size=SNAP_SIZE, run_before=run_before)


def test_clear_confirm_modal(snap_compare, make_app):
    async def run_before(pilot):
        await send(pilot, "Fill the cache a little.")
        await quiet(pilot)
        await pilot.press("f8")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SNAP_SIZE, run_before=run_before)


def test_command_palette(snap_compare, make_app):
    async def run_before(pilot):
        await quiet(pilot)
        await pilot.press("ctrl+p", *"Cache")
        await pilot.pause(0.05)
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SNAP_SIZE, run_before=run_before)


@pytest.fixture
def unsupported_engine():
    engine = FlakyEngine("tiny:odd", supported=False)
    yield engine
    engine.close()


def test_panels_for_unsupported_model(snap_compare, make_app, unsupported_engine):
    async def run_before(pilot):
        await send(pilot, "Hello")
        await quiet(pilot)

    app = make_app(engine=unsupported_engine)
    assert snap_compare(app, terminal_size=SNAP_SIZE, run_before=run_before)


def test_error_notification(snap_compare, make_app, engine):
    async def run_before(pilot):
        await send(pilot, "Hello")
        await quiet(pilot)
        engine.fail_next = "the prompt needs 9.1 GiB, the memory limit is 8.0 GiB"
        engine.fail_kind = "refused"
        await send(pilot, "Now read this very long document…")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SNAP_SIZE, run_before=run_before)


NARROW = (100, 30)


def test_narrow_terminal_summary_and_user_branches(snap_compare, make_app):
    """100×30: the panels fold into a summary line; an edited message shows ◀ 2/2 ▶."""

    async def run_before(pilot):
        await send(pilot, "What is a KV cache?")
        await pilot.press("escape", "up", "e")
        pilot.app.screen.query_one("#edit-area").load_text("What is a prefix cache?")
        await pilot.press("ctrl+s")
        await settle(pilot)
        await pilot.press("escape", "home")
        await quiet(pilot)

    assert snap_compare(make_app(), terminal_size=NARROW, run_before=run_before)


def test_conversation_settings_dialog(snap_compare, make_app):
    async def run_before(pilot):
        await send(pilot, "Hello")
        await pilot.press("f9")
        await pilot.pause()
        pilot.app.screen.query_one("#system").load_text("Answer in one short line.")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SNAP_SIZE, run_before=run_before)


# A default terminal (80×24) and a slightly larger one: the narrow layout, panels folded
# into the summary line; the app must fit and every key hint stay readable.
SMALL_SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((100, 30), id="100x30")]


@pytest.mark.parametrize("size", SMALL_SIZES)
def test_empty_app_small(snap_compare, make_app, size):
    assert snap_compare(make_app(), terminal_size=size, run_before=quiet)


@pytest.mark.parametrize("size", SMALL_SIZES)
def test_chat_small(snap_compare, make_app, size):
    async def run_before(pilot):
        await send(pilot, "What is a KV cache? Answer in one line.")
        await quiet(pilot)
        assert not chat_screen(pilot.app).panels_visible

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SMALL_SIZES)
def test_clear_confirm_modal_small(snap_compare, make_app, size):
    async def run_before(pilot):
        await send(pilot, "Fill the cache a little.")
        await quiet(pilot)
        await pilot.press("f8")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)
