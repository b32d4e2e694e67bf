"""The write window (docs/DESIGN.md §8.6) on a tiny model: entries admission defers reach
the SSD tier ``ssd_flush_idle_s`` after their commit, from an idle engine, so what is on
disk then restores the session after a crash, equal to a cold run; every file is written
and read in pieces of at most ``io.PIECE_BYTES`` (a test hook lowers it so that one
layer's K/V of one block is several pieces)."""

from __future__ import annotations

import shutil
import threading

import pytest
from engine_kit import assert_same, generate, make_engine, random_prompt
from tierchat.core.cache.ssd import io as ssd_io

MODEL = "tiny:llama"
SYSTEM = random_prompt(40, seed=5)  # two system blocks of 16 and 8 tokens of a third
BOUNDARIES = ((len(SYSTEM), "system"),)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(ssd_io, "PIECE_BYTES", 512)
    return 512


def settle(engine) -> None:
    """The writer's queue on disk, then the engine's idle step run on its thread (what
    its loop does once no request is held), then that on disk too."""
    assert engine.cache.ssd.flush(60)
    engine.call(engine.cache.write_due)
    assert engine.cache.ssd.flush(60)


def test_a_crash_after_the_window_restores_the_session(tmp_path, models_dir, small_pieces):
    clock = Clock()
    e = make_engine(MODEL, tmp_path, models_dir, bitwise=False, ssd_flush_idle_s=5.0)
    cold = make_engine(MODEL, tmp_path / "cold", models_dir, bitwise=False, no_cache=True)
    again = None
    try:
        e.cache.writes.clock = clock
        # a layer's K/V of one block is over the bound: several pieces a layer
        k = next(a for n, a in e.cache.spec.items() if n.endswith(".k"))
        assert 16 * (k[0][1] * k[0][3] * k[1].size) > small_pieces
        prompt = SYSTEM + random_prompt(30, seed=6)
        first, _ = generate(e, prompt, 6, boundaries=BOUNDARIES)
        seq = prompt + first.token_ids
        settle(e)
        w = e.stats().wear
        assert w.deferred > 0  # inside the window: only the system blocks are on disk
        on_disk = {p.name for p in (tmp_path / "kv").rglob("*.safetensors")}
        clock.now += 5.0
        settle(e)
        w = e.stats().wear
        assert w.deferred == 0 and e.cache.writes.admitted["idle"] > 0
        assert len(set((tmp_path / "kv").rglob("*.safetensors"))) > len(on_disk)
        # a crash now: a copy of the disk, the engine never closed
        shutil.copytree(tmp_path / "kv", tmp_path / "crashed")
        again = make_engine(
            MODEL, tmp_path / "after", models_dir, bitwise=False, cache_dir=tmp_path / "crashed"
        )
        nxt = seq + random_prompt(9, seed=7)
        want, want_handle = generate(cold, nxt, 6, boundaries=BOUNDARIES)
        got, got_handle = generate(again, nxt, 6, boundaries=BOUNDARIES)
        assert_same(want, want_handle, got, got_handle)
        m = got.metrics
        assert m.cached_by["ssd"] >= len(seq) - 1, m
        assert again.stats().ssd.corrupt == 0
    finally:
        for x in (e, cold, again):
            if x is not None:
                x.close()


def test_an_idle_engine_wakes_to_write_what_is_due(tmp_path, models_dir):
    """No job after the turn: the engine's own wait ends when the entries are due."""
    e = make_engine(MODEL, tmp_path, models_dir, bitwise=False, ssd_flush_idle_s=0.2)
    try:
        written = threading.Event()
        wake = e.cache.ssd.on_idle  # the engine's: the writer emptied its queue

        def idle() -> None:
            wake()
            written.set()

        e.cache.ssd.on_idle = idle
        generate(e, SYSTEM + random_prompt(30, seed=8), 6, boundaries=BOUNDARIES)
        for _ in range(100):  # each wait ends when the writer empties its queue
            if e.cache.writes.deferred == 0 and not e.cache.ssd.queue_depth:
                break
            written.wait(1.0)
            written.clear()
        assert e.cache.writes.deferred == 0
        assert e.cache.writes.admitted["idle"] > 0
    finally:
        e.close()
