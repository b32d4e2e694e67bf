"""The engine thread on a real tiny model: progress, cancel, errors, chunking."""

from __future__ import annotations

import pytest
from engine_kit import assert_same, generate, make_engine, random_prompt
from tierchat.core.api import Failed, Finished, GenerateRequest, PrefillProgress, TokenBatch
from tierchat.core.cache.schedule import chunk_ends, schedule_points
from tierchat.core.sampling_params import SamplingParams


@pytest.fixture
def engine(tmp_path, models_dir):
    e = make_engine("tiny:llama", tmp_path, models_dir, prefill_chunk=16)
    yield e
    e.close()


@pytest.fixture
def cold(tmp_path, models_dir):
    e = make_engine("tiny:llama", tmp_path / "cold", models_dir, no_cache=True, prefill_chunk=16)
    yield e
    e.close()


def test_schedule_is_chunk_multiples_message_ends_and_n_minus_1():
    assert schedule_points(51, 16) == [16, 32, 48, 50]
    assert schedule_points(51, 16, ((40, "user"), (60, "user"), (10, "system"))) == [
        10, 16, 32, 40, 48, 50
    ]  # fmt: skip
    assert schedule_points(1, 16) == []
    points = schedule_points(51, 16, ((40, "user"),))
    assert chunk_ends(20, points) == [32, 40, 48, 50]
    assert chunk_ends(50, points) == []


def test_cold_chunk_ends_equal_with_cache_on_and_off(tmp_path, models_dir):
    """The prefill schedule is a function of the prompt: a cold run with the cache on
    computes exactly the chunks of a run with the cache off."""
    on = make_engine("tiny:llama", tmp_path / "on", models_dir, prefill_chunk=32)
    off = make_engine("tiny:llama", tmp_path / "off", models_dir, prefill_chunk=32, no_cache=True)
    try:
        prompt = random_prompt(100, seed=3)
        bounds = ((7, "system"), (45, "user"), (70, "assistant"), (90, "user"))
        _, h_on = generate(on, prompt, max_tokens=2, boundaries=bounds)
        _, h_off = generate(off, prompt, max_tokens=2, boundaries=bounds)
        assert h_on.trace.restored_position == 0
        assert h_on.trace.chunk_ends == h_off.trace.chunk_ends == (7, 32, 45, 64, 70, 90, 96, 99)
        # a restore at a schedule point computes the rest in the cold run's chunks
        _, again = generate(on, prompt[:95] + (1, 2, 3), max_tokens=2, boundaries=bounds)
        assert again.trace.restored_position == 90 and again.trace.chunk_ends == (96, 97)
    finally:
        on.close()
        off.close()


def test_prefill_progress_counts_up_to_the_tokens_prefilled(engine):
    handle = engine.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=3), prompt_ids=random_prompt(100))
    )
    events = list(handle.events())
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    # chunk by chunk, then the last prompt token with the first decode step: the count
    # ends at the tokens the turn's metrics say were prefilled
    assert [p.done for p in progress] == [0, 16, 32, 48, 64, 80, 96, 99, 100]
    assert all(p.total == 100 for p in progress)
    assert isinstance(events[-1], Finished)
    assert events[-1].metrics.prefill_tokens == progress[-1].done
    assert sum(len(e.token_ids) for e in events if isinstance(e, TokenBatch)) <= 3


def test_cancel_during_decode_stops_within_one_token(engine, cold):
    prompt = random_prompt(60, seed=2)
    seen = []

    def on_event(event):
        if isinstance(event, TokenBatch) and event.token_ids:
            seen.append(event)
            if len(seen) == 2:
                handle.cancel()

    handle = engine.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=50), prompt_ids=prompt), on_event
    )
    res = handle.wait(60)
    assert isinstance(res, Finished) and res.metrics.finish_reason == "cancelled"
    assert len(res.token_ids) == 2
    # the stored prompt + partial reply is consistent: continuing from it equals cold
    cont = prompt + res.token_ids + random_prompt(10, seed=3)
    a, ha = generate(cold, cont)
    b, hb = generate(engine, cont)
    assert_same(a, ha, b, hb)
    assert b.metrics.cached_tokens == len(prompt) + 2


def test_cancel_during_prefill_keeps_finished_blocks(engine, cold):
    prompt = random_prompt(200, seed=4)

    def on_event(event):
        if isinstance(event, PrefillProgress) and event.done >= 48:
            handle.cancel()

    handle = engine.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=4), prompt_ids=prompt), on_event
    )
    res = handle.wait(60)
    assert isinstance(res, Failed) and res.kind == "cancelled"
    assert res.kept_tokens == 48 and "kept 48 of 200" in res.message
    assert engine.stats().hot.entries == 3  # the blocks prefilled before the cancel
    a, ha = generate(cold, prompt)
    b, hb = generate(engine, prompt)
    assert_same(a, ha, b, hb)
    assert b.metrics.cached_by["hot"] == 48


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3"])
def test_cancel_during_prefill_keeps_every_finished_chunk(arch, tmp_path, models_dir):
    """Esc during a prefill keeps what the finished chunks computed, on state and window
    models too (the live cache stays resident): the retry's cached tokens are the tokens
    done before the cancel, and its output equals a cold run."""
    engine = make_engine(f"tiny:{arch}", tmp_path / "on", models_dir, prefill_chunk=16)
    cold = make_engine(
        f"tiny:{arch}", tmp_path / "off", models_dir, prefill_chunk=16, no_cache=True
    )
    try:
        prompt = random_prompt(120, seed=5)
        seen = []

        def on_event(event):
            if isinstance(event, PrefillProgress):
                seen.append(event.done)
                if event.done >= 40:
                    handle.cancel()

        handle = engine.submit(
            GenerateRequest(sampling=SamplingParams(max_tokens=4), prompt_ids=prompt), on_event
        )
        res = handle.wait(60)
        assert isinstance(res, Failed) and res.kind == "cancelled"
        assert res.kept_tokens == seen[-1] == 48
        a, ha = generate(cold, prompt)
        b, hb = generate(engine, prompt)
        assert b.metrics.cached_tokens == 48
        assert_same(a, ha, b, hb)
    finally:
        engine.close()
        cold.close()


def test_empty_prompt_and_unknown_tier_are_errors(engine):
    res = engine.submit(GenerateRequest(prompt_ids=())).wait(30)
    assert isinstance(res, Failed) and "empty prompt" in res.message
    with pytest.raises(ValueError, match="unknown tier"):
        engine.clear("warm")


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_same_prompt_again_samples_from_kept_logprobs_as_a_cold_run(engine, cold, max_tokens):
    prompt = random_prompt(45, seed=3)
    generate(engine, prompt, max_tokens=max_tokens)
    a, ha = generate(cold, prompt, max_tokens=max_tokens)
    b, hb = generate(engine, prompt, max_tokens=max_tokens)
    assert_same(a, ha, b, hb)
    m = b.metrics
    assert (m.cached_tokens, m.prefill_tokens, m.cached_kind["resident"]) == (45, 0, 45)
    # the cache went on holding prompt + reply: the next turn continues from it exactly
    longer = prompt + b.token_ids + random_prompt(20, seed=4)
    c, hc = generate(cold, longer)
    d, hd = generate(engine, longer)
    assert_same(c, hc, d, hd)
    assert d.metrics.cached_tokens >= len(prompt) + max_tokens - 1


def test_same_prompt_again_draws_what_a_seeded_cold_run_draws(engine, cold):
    prompt = random_prompt(30, seed=5)
    sampled = dict(max_tokens=6, temperature=1.5, seed=11)
    a, _ = generate(cold, prompt, **sampled)
    generate(engine, prompt, **sampled)
    b, _ = generate(engine, prompt, **sampled)
    assert b.metrics.prefill_tokens == 0 and b.token_ids == a.token_ids
    c, _ = generate(engine, prompt, **{**sampled, "seed": 12})
    assert c.metrics.prefill_tokens == 0 and c.token_ids != a.token_ids


def test_call_runs_on_the_engine_thread_after_queued_jobs(engine):
    import threading

    import mlx.core as mx

    handle = engine.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=2), prompt_ids=tuple(random_prompt(40)))
    )
    # queued behind the generation: by the time it runs, the generation has finished
    name, done = engine.call(lambda: (threading.current_thread().name, handle.done))
    assert name == "tierchat-engine" and done
    assert engine.call(lambda: (mx.array([1, 2]) * 3).tolist()) == [3, 6]
    with pytest.raises(ZeroDivisionError):
        engine.call(lambda: 1 / 0)
    assert engine.call(lambda: "still alive") == "still alive"


def test_buffer_cache_is_cleared_on_the_engine_thread_after_ssd_work(engine, monkeypatch):
    import threading

    from tierchat.core.engine import engine as engine_mod

    cleared: list[str] = []
    changed = threading.Condition()
    real = engine_mod.mx.clear_cache

    def clear_cache():
        with changed:
            cleared.append(threading.current_thread().name)
            changed.notify_all()
        real()

    def cleared_after(n: int) -> bool:
        """Wait for a clear beyond the first ``n`` (the writer calls ``on_idle`` just
        after ``flush`` sees its queue empty, so the clear may come after the flush)."""
        with changed:
            return changed.wait_for(lambda: len(cleared) > n, timeout=60)

    monkeypatch.setattr(engine_mod.mx, "clear_cache", clear_cache)
    prompt = random_prompt(40)
    generate(engine, prompt)
    # a first request's entries wait in RAM (admission, docs/DESIGN.md §8.6): clearing the
    # hot tier writes them first; once the writer has emptied its queue, a clear is queued
    engine.clear("hot")
    engine.cache.ssd.flush()
    assert cleared_after(0) and set(cleared) == {"tierchat-engine"}
    engine.clear("resident")
    engine.cache.ssd.on_idle = None  # from here, only the SSD restore queues a clear
    engine.cache.ssd.flush()
    engine.call(lambda: None)
    before = len(cleared)
    res, _ = generate(engine, prompt)
    assert res.metrics.cached_by.get("ssd")
    assert cleared_after(before) and set(cleared) == {"tierchat-engine"}


def test_core_never_imports_textual():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import tierchat.core.engine.engine, tierchat.core.chat.session, tierchat.core.models.loading\n"
        "import tierchat.core.cache.prefix, tierchat.core.memory.pressure, tierchat.config.settings\n"
        "assert 'textual' not in sys.modules, 'textual was imported'\n"
        "assert 'mlx.core' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_closing_an_engine_frees_the_model(tmp_path, models_dir):
    """A restart in one process (replay, the bench) must not hold two models: after close,
    nothing of the engine keeps the weights (the folded schedule's head closure included)."""
    import gc
    import weakref

    engine = make_engine("tiny:llama", tmp_path, models_dir, bitwise=False)
    trunk = weakref.ref(engine.loaded.model.model)
    assert engine.runtime.plan.folds
    engine.close()
    gc.collect()
    assert trunk() is None


def test_a_hold_clears_host_buffers_only_for_files_written_while_idle(monkeypatch):
    """On CUDA the SSD writer is held while requests are (``ssd_write_while_busy`` off).
    Files written while no request was held leave host-read buffers in MLX's pool: the
    hold clears it before the first step. Files written under backpressure while requests
    were held do not make the next hold clear (the requests ran beside those buffers; a
    clear costs the arriving requests ~60 ms on an 8B model): it waits for no request held
    nor waiting."""
    import threading
    import types

    from tierchat.core.engine import engine as engine_mod

    clears: list[int] = []
    monkeypatch.setattr(engine_mod.mx, "clear_cache", lambda: clears.append(1))
    cache = types.SimpleNamespace(
        ssd_files_written=0, hold_writes=lambda holder: True, release_writes=lambda holder: None
    )
    eng = engine_mod.Engine.__new__(engine_mod.Engine)  # the hold's state only: no thread
    eng.executor = types.SimpleNamespace(runtime=types.SimpleNamespace(cache=cache))
    eng._write_while_busy, eng._writes_held = False, False
    eng._saves_at_clear = eng._saves_at_release = 0
    eng._clear_when_idle, eng._release_queued = False, threading.Event()
    eng._hold_writes(True)
    assert not clears
    cache.ssd_files_written = 3  # under backpressure, requests held
    eng._hold_writes(False)
    eng._hold_writes(True)
    assert not clears and eng._clear_when_idle
    eng._hold_writes(False)
    cache.ssd_files_written = 5  # while idle; then a request arrives mid-queue
    eng._hold_writes(True)
    assert clears == [1] and not eng._clear_when_idle
