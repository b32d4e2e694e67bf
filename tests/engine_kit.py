"""Helpers for tests that drive the real engine on tiny models."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from tierchat.config.settings import Settings
from tierchat.core.api import Finished, GenerateRequest
from tierchat.core.engine import Engine

LOGPROB_TOL = 1e-4  # float32: cached vs cold logprobs of the first tokens


def make_engine(model: str, tmp: Path, models_dir: Path, **overrides) -> Engine:
    """A loaded engine on ``model`` with small blocks and its cache under ``tmp``."""
    values = dict(
        block_size=16,
        cache_dir=tmp / "kv",
        models_dir=models_dir,
        data_dir=tmp / "data",
        hot_bytes=256 << 20,
        ssd_bytes=1 << 30,
    )
    values.update(overrides)
    engine = Engine(Settings(**values))
    engine.record_logprobs = 3
    loaded = engine.load_model(model).wait(120)
    assert not hasattr(loaded, "message"), loaded
    return engine


def random_prompt(n: int, seed: int = 0, vocab: int = 250) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.randrange(1, vocab) for _ in range(n))


def generate(engine: Engine, prompt, max_tokens: int = 8, **kw):
    handle = engine.submit(GenerateRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens, **kw))
    result = handle.wait(120)
    assert isinstance(result, Finished), result
    return result, handle


def assert_same(cold, cold_handle, hot, hot_handle) -> None:
    """Greedy tokens equal and the first logprob vectors within LOGPROB_TOL."""
    assert hot.token_ids == cold.token_ids
    assert len(hot_handle.logprobs) == len(cold_handle.logprobs) > 0
    for a, b in zip(cold_handle.logprobs, hot_handle.logprobs, strict=True):
        assert float(np.abs(a - b).max()) < LOGPROB_TOL
    m = hot.metrics
    assert m.cached_tokens + m.prefill_tokens == m.prompt_tokens
    assert sum(m.cached_by.values()) == m.cached_tokens
