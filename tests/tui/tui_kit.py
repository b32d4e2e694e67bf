"""Helpers for the TUI tests: a fake engine that can misbehave, and waits.

Deterministic by construction: the store's clock is fixed, the progress bars get a
``MockClock``, ``animation_level = "none"``, the cursor does not blink in headless runs,
the fake engine models its timings from token counts, and :func:`settle` waits for the
engine thread, the workers and the message queues before anything is asserted.

(A module of its own, not ``conftest``: ``tests/conftest.py`` exists too, and
``from conftest import`` would depend on which of the two was imported last.)
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from textual.pilot import Pilot

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for fakes

from fakes import FakeEngine
from tierchat.core.api import CacheStats, Failed, PrefillProgress

FIXED_EPOCH = 1_767_225_600.0  # 2026-01-01 00:00 UTC
SIZE = (100, 32)  # Pilot tests (narrow: panels folded); snapshots use their own size
WIDE = (150, 40)  # Pilot tests that read the full cache panels


def fixed_clock() -> float:
    return FIXED_EPOCH


class FlakyEngine(FakeEngine):
    """A fake engine whose ``clear`` and ``stats`` can be told to misbehave."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clear_error: Exception | None = None
        self.ssd_errors = 0
        self.memory_level = "ok"
        self.cleared: list[str] = []
        self.fail_kind = ""  # the kind of the Failed that ``fail_next`` emits
        self.prefill_gate = threading.Event()
        self.prefill_gate.set()
        self.prefill_held = threading.Event()  # a prefill waits at the closed gate

    def clear(self, tier: str) -> None:
        if self.clear_error is not None:
            raise self.clear_error
        self.cleared.append(tier)
        super().clear(tier)

    def stats(self) -> CacheStats:
        stats = super().stats()
        if self.ssd_errors:
            reason = "disk full (ENOSPC); cap shrunk"
            ssd = replace(stats.ssd, errors=self.ssd_errors, reason=reason)
            stats = replace(stats, ssd=ssd)
        if self.memory_level != "ok":
            stats = replace(stats, memory=replace(stats.memory, level=self.memory_level))
        return stats

    def submit(self, request, on_event=None):
        """As FakeEngine, but a prefill holds on ``prefill_gate`` after its first progress
        event while the gate is clear (to look at the progress bar)."""
        if on_event is None:
            return super().submit(request, on_event)

        def held(event):
            if isinstance(event, Failed) and self.fail_kind:
                event = Failed(event.message, self.fail_kind)
            on_event(event)
            if isinstance(event, PrefillProgress) and event.done < event.total:
                if not self.prefill_gate.is_set():
                    self.prefill_held.set()
                self.prefill_gate.wait()

        return super().submit(request, held)


def chat_screen(app):
    """The main chat screen (the bottom of the stack, under any modal)."""
    from tierchat.tui.screens.chat import ChatScreen

    screen = app.screen_stack[0]
    assert isinstance(screen, ChatScreen)
    return screen


async def settle(pilot: Pilot, timeout: float = 10.0) -> None:
    """Wait until no reply streams (in any conversation), no model loads and every
    worker and queue is idle."""
    app = pilot.app
    deadline = time.monotonic() + timeout
    while True:
        await pilot.pause()
        await app.workers.wait_for_complete()
        screen = chat_screen(app)
        if not screen.pane.turns.turns and not screen.loading_model:
            break
        if time.monotonic() > deadline:
            raise AssertionError("the app did not settle")
        await asyncio.sleep(0.01)
    await pilot.pause()
    await app.workers.wait_for_complete()
    await pilot.pause()


async def wait_for(pilot: Pilot, predicate, timeout: float = 30.0, what: str = "") -> None:
    """Pump the app until ``predicate()`` holds (an ``AssertionError`` after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or 'the condition'}")
        await pilot.pause()
        await asyncio.sleep(0.01)


async def enter(pilot: Pilot, text: str) -> None:
    """Type ``text`` into the chat input and press Enter, without waiting for a reply."""
    from tierchat.tui.widgets.chat_input import ChatInput

    box = chat_screen(pilot.app).query_one(ChatInput)
    box.focus()
    box.insert(text)
    await pilot.press("enter")


async def send(pilot: Pilot, text: str) -> None:
    """Type ``text`` into the chat input, press Enter, and wait for the reply."""
    from tierchat.tui.widgets.chat_input import ChatInput

    await settle(pilot)
    box = chat_screen(pilot.app).query_one(ChatInput)
    box.focus()
    box.insert(text)
    await pilot.press("enter")
    await settle(pilot)


# ------------------------------------------------------------------ the real engine

REAL_TIMEOUT_S = 180.0
"""How long a step through the real engine on a tiny model may take (a loaded CI machine)."""


def real_settings(tmp_path: Path, **overrides):
    """Settings for the real engine on ``tiny:llama`` under ``tmp_path`` (16-token blocks,
    small tiers, 8-token replies); ``overrides`` replace any field, a sampling key
    (``max_tokens=6``, ``temperature=0.0``) one of ``Settings.sampling``."""
    from tierchat.config.settings import Settings
    from tierchat.core.sampling_params import FIELDS, SamplingParams

    values = dict(
        model="tiny:llama",
        data_dir=tmp_path / "data",
        cache_dir=tmp_path / "kv",
        models_dir=tmp_path / "models",
        block_size=16,
        hot_bytes=64 << 20,
        ssd_bytes=256 << 20,
    )
    sampling = {"max_tokens": 8}
    for key, value in overrides.items():
        (sampling if key in FIELDS else values)[key] = value
    return Settings(**values, sampling=SamplingParams(**sampling))


@contextlib.asynccontextmanager
async def real_app(settings, size: tuple[int, int] = (150, 40)):
    """The app over the real engine and an in-memory store, started, with the model loaded
    (the app loads ``settings.model`` itself), then closes the
    engine and the store. Yields ``(app, pilot, engine, store)``; the engine (MLX) is imported
    here, not at collection."""
    from textual.clock import MockClock
    from tierchat.core.chat.store import ConversationStore
    from tierchat.core.engine.engine import Engine
    from tierchat.tui.app import TierchatApp

    engine = Engine(settings)
    store = ConversationStore(":memory:", clock=fixed_clock)
    app = TierchatApp(engine, store, settings, clock=MockClock(0.0))
    app.animation_level = "none"
    try:
        async with app.run_test(size=size) as pilot:
            await settle(pilot, timeout=REAL_TIMEOUT_S)
            yield app, pilot, engine, store
    finally:
        engine.close()
        store.close()
