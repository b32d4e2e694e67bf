"""Fixtures for the Pilot and snapshot tests: an app factory on the fake engine
(helpers in ``tui_kit.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from textual.clock import MockClock
from tierchat.config.settings import Settings
from tierchat.core.chat.store import ConversationStore
from tierchat.core.sampling_params import SamplingParams
from tui_kit import FlakyEngine, fixed_clock


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio (``pytestmark = pytest.mark.anyio`` in each module)."""
    return "asyncio"


@pytest.fixture(autouse=True)
def notifications_kept(monkeypatch) -> None:
    """Tests read ``app._notifications`` after the events that raised them, but a
    notification leaves it once its toast's timeout (3-8 s of wall time) has passed, which
    a loaded machine can spend between the two: every notification of a test lasts an
    hour."""
    from textual.app import App

    notify = App.notify

    def lasting(self, message, **kw):
        kw["timeout"] = 3600
        return notify(self, message, **kw)

    monkeypatch.setattr(App, "notify", lasting)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        sampling=SamplingParams(max_tokens=64),
        model="demo",
        data_dir=tmp_path / "data",
        cache_dir=tmp_path / "kv",
        models_dir=tmp_path / "models",
    )


@pytest.fixture
def store() -> ConversationStore:
    store = ConversationStore(":memory:", clock=fixed_clock)
    yield store
    store.close()


@pytest.fixture
def engine() -> FlakyEngine:
    engine = FlakyEngine("demo")
    yield engine
    engine.gate.set()
    engine.prefill_gate.set()
    engine.close()


@pytest.fixture
def make_app(engine, store, settings) -> Callable:
    """``make_app(**overrides)`` -> a ``TierchatApp`` on the fake engine."""
    from tierchat.tui.app import TierchatApp

    def factory(engine=engine, store=store, settings=settings, **kwargs):
        app = TierchatApp(engine, store, settings, clock=MockClock(0.0), **kwargs)
        app.animation_level = "none"
        return app

    return factory
