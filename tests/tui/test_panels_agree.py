"""Issue 21: the cache panels agree with the engine's counters and its Events log, after
cold and hot turns and after each clear (F5-F8), on the real engine (``tiny:llama``).

Each check reads what the panels *show* (their rendered lines) and the snapshot they
were fed, and compares both with the counters and the event texts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from textual.clock import MockClock
from tierchat.config.settings import Settings
from tierchat.core.chat.store import ConversationStore
from tierchat.core.sampling_params import SamplingParams
from tui_kit import chat_screen, fixed_clock, send, settle

engine_module = pytest.importorskip("tierchat.core.engine.engine")

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT_S = 180.0
EVICTED = re.compile(r"hot: evicted (?:(\d+) blocks?)?(?:, )?(?:(\d+) tails?/checkpoints?)?$")


def text_of(panels, selector: str) -> str:
    return str(panels.query_one(selector).render())


def log_lines(panels) -> list[str]:
    from textual.widgets import RichLog

    return [strip.text.rstrip() for strip in panels.query_one(RichLog).lines]


async def agree(pilot, engine) -> tuple:
    """Poll, then check every panel line against the snapshot and the events; returns
    the snapshot."""
    from textual.widgets import RichLog
    from tierchat.tui.widgets.cache_panels import CachePanels

    screen = chat_screen(pilot.app)
    screen.app.poll_stats()
    await pilot.pause()
    panels = screen.query_one(CachePanels)
    s = panels.stats
    assert s is not None and s.model == "tiny:llama"
    # Hot: its counters, and evicted = every eviction the Events log reported
    blocks = tails = 0
    for _, text in s.events:
        if m := EVICTED.match(text):
            blocks += int(m[1] or 0)
            tails += int(m[2] or 0)
    assert (blocks, tails) == (s.hot.evictions, s.tails.evictions)
    evicted = s.hot.evictions + s.tails.evictions
    assert text_of(panels, "#hot-counters") == (f"entries used {s.hot.hits} · evicted {evicted}")
    lk = s.lookups
    assert text_of(panels, "#hits-rate") == (
        f"hit rate {lk.hit_rate:.0%} ({lk.hits}/{lk.lookups} turns) · cold {lk.cold}"
    )
    assert text_of(panels, "#hot-size").endswith(f"· {s.hot.entries} entries")
    assert text_of(panels, "#hot-resident").startswith(f"resident {s.resident.tokens:,} tok")
    assert text_of(panels, "#ssd-size").endswith(f"· {s.ssd.entries:,} files")
    assert text_of(panels, "#tails-saved").endswith(f"· evicted {s.tails.evictions}")
    assert text_of(panels, "#checkpoints-text") == (
        f"checkpoints held {s.tails.checkpoints} · used {s.tails.checkpoint_hits}×"
    )
    # Events: every event shown whole, wrapped within the log (nothing cropped)
    log = panels.query_one(RichLog)
    lines = log_lines(panels)
    width = log.scrollable_content_region.width
    assert lines and all(len(line) <= width for line in lines)
    shown = " ".join(" ".join(lines).split())
    for seq, text in s.events:
        assert " ".join(f"{seq:>4} {text}".split()) in shown, text
    return s


async def test_panels_agree_with_counters_and_events_through_turns_and_clears(tmp_path: Path):
    from tierchat.tui.app import TierchatApp

    settings = Settings(
        sampling=SamplingParams(max_tokens=8),
        model="tiny:llama",
        data_dir=tmp_path / "data",
        cache_dir=tmp_path / "kv",
        models_dir=tmp_path / "models",
        block_size=256,
        hot_bytes=64 << 20,
        ssd_bytes=256 << 20,
        tail_entries=1,
    )
    engine = engine_module.Engine(settings)
    store = ConversationStore(":memory:", clock=fixed_clock)
    app = TierchatApp(engine, store, settings, clock=MockClock(0.0))
    app.animation_level = "none"
    try:
        async with app.run_test(size=(150, 60)) as pilot:
            await settle(pilot, timeout=TIMEOUT_S)
            screen = chat_screen(app)

            await send(pilot, "Hi")  # cold
            s = await agree(pilot, engine)
            assert s.last_turn.cached_tokens == 0 and s.hot.misses >= 1

            await send(pilot, "And again")  # a new tail: the first one is evicted
            s = await agree(pilot, engine)
            assert s.tails.evictions >= 1 and s.last_turn.cached_tokens > 0

            await pilot.press("ctrl+r")  # hot: the same prompt again
            await settle(pilot, timeout=TIMEOUT_S)
            s = await agree(pilot, engine)
            assert s.resident.tokens > 0

            for key, tier in (("f5", "hot"), ("f7", "tails"), ("f6", "ssd"), ("f8", "all")):
                await send(pilot, f"before {tier}")  # something in every tier to clear
                before = await agree(pilot, engine)
                app._notifications.clear()
                await pilot.press(key, "y")
                await settle(pilot, timeout=TIMEOUT_S)
                s = await agree(pilot, engine)
                (note,) = [n.message for n in app._notifications if n.title == "Cache cleared"]
                assert "already empty" not in note, note
                if tier in ("hot", "all"):
                    assert s.hot.entries == 0 and s.resident.tokens == 0
                    assert f"resident cache −{before.resident.tokens:,} tokens" in note
                if tier in ("ssd", "all"):
                    assert s.ssd.entries == 0 and f"SSD −{before.ssd.entries}" in note
                if tier == "tails":
                    assert s.tails.entries == 0 and s.tails.checkpoints == 0
                assert any(text.startswith(f"cleared {tier}") for _, text in s.events)
            assert screen.query_one("#hot-counters")
    finally:
        engine.close()
        store.close()


def test_the_last_turn_record_is_the_running_turn_from_its_first_token(tmp_path: Path):
    """The Last-turn panel showed the previous turn until a reply had finished decoding."""
    from tierchat.core.api import Finished, GenerateRequest, TokenBatch

    settings = Settings(
        model="tiny:llama",
        cache_dir=tmp_path / "kv",
        models_dir=tmp_path / "models",
        block_size=16,
    )
    engine = engine_module.Engine(settings)
    try:
        engine.load_model("tiny:llama").wait(TIMEOUT_S)
        prompt = engine.tokenizer.encode("The running turn is what the panel shows.")
        seen = []

        def on_event(event) -> None:
            if isinstance(event, TokenBatch) and not seen:
                seen.append(engine.stats().last_turn)  # while the reply decodes

        for ids in (prompt[:20], prompt):  # the second turn reuses the first one's blocks
            seen.clear()
            request = GenerateRequest(sampling=SamplingParams(max_tokens=6), prompt_ids=ids)
            done = engine.submit(request, on_event).wait(TIMEOUT_S)
            assert isinstance(done, Finished)
            (during,) = seen
            m = done.metrics
            assert (during.prompt_tokens, during.cached_tokens, during.prefill_tokens) == (
                m.prompt_tokens,
                m.cached_tokens,
                m.prefill_tokens,
            )
            assert during.ttft_s == m.ttft_s and during.cached_by == m.cached_by
        assert m.cached_tokens > 0
    finally:
        engine.close()
