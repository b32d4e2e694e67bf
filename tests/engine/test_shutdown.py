"""The engine's bounded stop (docs/DESIGN.md §2, §15) on a real tiny model:
``Engine.shutdown(timeout_s)`` writes what the cache holds for the SSD tier within the
bound and closes; ``close=False`` writes the queue and leaves the engine running."""

from __future__ import annotations

from engine_kit import generate, make_engine, random_prompt


def test_shutdown_writes_the_cache_and_closes_and_a_restart_finds_it(tmp_path, models_dir):
    engine = make_engine("tiny:llama", tmp_path, models_dir)
    generate(engine, random_prompt(70))
    assert engine.info is not None and engine.info.context_length
    flushed = engine.shutdown(30.0)
    assert flushed.dropped == 0 and flushed.written > 0  # deferred entries, written at close
    assert engine.info is None and engine.writes_queued == 0  # closed: no model
    again = make_engine("tiny:llama", tmp_path, models_dir)
    try:
        assert again.stats().ssd.entries == flushed.written
    finally:
        again.close()


def test_shutdown_without_close_writes_the_queue_and_the_engine_runs_on(tmp_path, models_dir):
    engine = make_engine("tiny:llama", tmp_path, models_dir, ssd_flush_idle_s=0.0)
    try:
        generate(engine, random_prompt(70))
        flushed = engine.shutdown(30.0, close=False)
        assert flushed.dropped == 0 and engine.writes_queued == 0
        assert engine.info is not None
        generate(engine, random_prompt(40, seed=1))  # a reply (Finished) after the stop
    finally:
        engine.close()
