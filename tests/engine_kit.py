"""Helpers for tests that drive the real engine on tiny models."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tierchat.config.settings import Settings
from tierchat.core.api import Finished, GenerateRequest
from tierchat.core.chat.conversation_settings import ConversationSettings
from tierchat.core.chat.session import ChatSession
from tierchat.core.chat.store import ConversationStore
from tierchat.core.engine.engine import Engine
from tierchat.core.sampling_params import SamplingParams

LOGPROB_TOL = 1e-4  # float32: cached vs cold logprobs of the first tokens


def make_engine(
    model: str, tmp: Path, models_dir: Path, clock: Callable[[], float] | None = None, **overrides
) -> Engine:
    """A loaded engine on ``model`` with small blocks and its cache under ``tmp``, on the
    bitwise schedule unless ``bitwise=False`` is given (tests of the folded schedule);
    ``clock``: the scheduler's clock (:func:`still_clock`: pieces and groups sized by the
    settings alone, whatever the machine's load)."""
    values = dict(
        bitwise=True,  # the CPU's default too; explicit, so a GPU runs the same tests
        block_size=16,
        cache_dir=tmp / "kv",
        models_dir=models_dir,
        data_dir=tmp / "data",
        hot_bytes=256 << 20,
        ssd_bytes=1 << 30,
        # deferred entries wait for close or eviction, whatever the machine's load (tests
        # of the write window set it: tests/engine/test_ssd_window.py)
        ssd_flush_idle_s=3600.0,
    )
    values.update(overrides)
    engine = Engine(Settings(**values), clock=clock) if clock else Engine(Settings(**values))
    engine.record_logprobs = 3
    loaded = engine.load_model(model).wait(120)
    assert not hasattr(loaded, "message"), loaded
    return engine


def still_clock() -> float:
    """A scheduler clock that never moves: no forward is measured (the cost model knows
    nothing) and no step's prefill budget runs out, so what the scheduler decides depends
    on the requests and the settings only (with ``choose_recompute=False``: no kept rate)."""
    return 0.0


@contextmanager
def engine_maker(
    tmp: Path, models_dir: Path, model: str = "tiny:llama", **defaults
) -> Iterator[Callable[..., Engine]]:
    """``make(model=None, **overrides)``: a :func:`make_engine` of ``model`` (or the one
    given) under ``tmp``, ``defaults`` beneath the overrides; every engine made is closed
    on exit. The body of an ``engines`` fixture."""
    made: list[Engine] = []
    default_model = model

    def make(model: str | None = None, **overrides) -> Engine:
        e = make_engine(model or default_model, tmp, models_dir, **{**defaults, **overrides})
        made.append(e)
        return e

    try:
        yield make
    finally:
        for e in made:
            e.close()


def random_prompt(n: int, seed: int = 0, vocab: int = 250) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.randrange(1, vocab) for _ in range(n))


def request(prompt_ids, **kw) -> GenerateRequest:
    """A request from flat keywords: ``SamplingParams`` fields (``max_tokens``,
    ``temperature``...) and ``GenerateRequest``'s own (``use_cache``, ``boundaries``,
    ``teacher_ids``)."""
    own = {k: kw.pop(k) for k in ("use_cache", "boundaries", "teacher_ids") if k in kw}
    return GenerateRequest(tuple(prompt_ids), SamplingParams(**kw), **own)


def generate(engine: Engine, prompt, max_tokens: int = 8, **kw):
    """Submit ``prompt`` and wait for its reply; ``kw`` as :func:`request` takes them."""
    handle = engine.submit(request(prompt_ids=prompt, max_tokens=max_tokens, **kw))
    result = handle.wait(120)
    assert isinstance(result, Finished), result
    return result, handle


def assert_same(cold, cold_handle, hot, hot_handle) -> None:
    """Greedy tokens equal and the first logprob vectors within LOGPROB_TOL."""
    assert hot.token_ids == cold.token_ids
    assert len(hot_handle.trace.logprobs) == len(cold_handle.trace.logprobs) > 0
    for a, b in zip(cold_handle.trace.logprobs, hot_handle.trace.logprobs, strict=True):
        assert float(np.abs(a - b).max()) < LOGPROB_TOL
    m = hot.metrics
    assert m.cached_tokens + m.prefill_tokens == m.prompt_tokens
    assert sum(m.cached_by.values()) == m.cached_tokens
    assert sum(m.cached_kind.values()) == m.cached_tokens


class Lockstep:
    """A cached and a cold chat session doing the same thing."""

    def __init__(self, model, tmp, models_dir, max_tokens=6, **overrides):
        self.model, self.tmp, self.models_dir, self.overrides = model, tmp, models_dir, overrides
        self.cold_engine = make_engine(model, tmp / "cold", models_dir, no_cache=True, **overrides)
        self.cold = ChatSession(
            self.cold_engine,
            ConversationStore(tmp / "cold.sqlite"),
            ConversationSettings(
                sampling=SamplingParams(max_tokens=max_tokens), swipe_temperature=0.0
            ),
        )
        self.hot_engine = make_engine(model, tmp, models_dir, **overrides)
        self.store = ConversationStore(tmp / "hot.sqlite")
        self.hot = ChatSession(
            self.hot_engine,
            self.store,
            ConversationSettings(
                sampling=SamplingParams(max_tokens=max_tokens), swipe_temperature=0.0
            ),
        )
        self.last_sequence = ()  # prompt + reply token ids of the latest finished turn
        self.last_prompt = ()

    def run(self, op, *args):
        a = getattr(self.cold, op)(*args)
        b = getattr(self.hot, op)(*args)
        if not hasattr(a, "wait"):
            return None
        ra, rb = a.wait(120), b.wait(120)
        assert_same(ra, a.request_handle, rb, b.request_handle)
        self.last_prompt = b.prompt.token_ids
        self.last_sequence = b.prompt.token_ids + rb.token_ids
        return rb.metrics

    def reused(self, previous) -> int:
        """Tokens of the latest prompt that continue ``previous`` (the stored sequence).

        Equal to ``len(previous)`` when the reply's ids were spliced back whole; shorter
        when a reply's bytes cannot round-trip through text (random tiny models emit
        invalid UTF-8), in which case the prompt really differs from there on.
        """
        n = 0
        for a, b in zip(previous, self.last_prompt, strict=False):
            if a != b:
                break
            n += 1
        return n

    def restart(self):
        self.hot_engine.close()
        self.hot_engine = make_engine(self.model, self.tmp, self.models_dir, **self.overrides)
        self.hot.engine = self.hot_engine

    def close(self):
        self.cold_engine.close()
        self.hot_engine.close()


def mlx_lm_tokens(engine: Engine, prompt, max_tokens: int, **processors) -> tuple[int, ...]:
    """Greedy tokens of mlx-lm's ``generate_step`` over the whole prompt with its own
    logits processors (``make_logits_processors(**processors)``), fresh cache, on the
    engine thread."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    def run():
        steps = generate_step(
            mx.array(prompt),
            engine.loaded.model,
            max_tokens=max_tokens,
            logits_processors=make_logits_processors(**processors),
        )
        return tuple(tok for tok, _ in steps)

    return engine.call(run, timeout=120)


class ScriptedEngine:
    """A real engine whose replies are scripted: each submit takes the next text of
    ``replies`` (while any are left) and decodes exactly its tokens, teacher-forced
    through the engine's own decode loop (``GenerateRequest.teacher_ids``). The prompt,
    its prefill and the cache are the real ones; only the sampled tokens are given, so
    tool-call paths can be tested on tiny random models. ``requests``: every request
    submitted, as submitted; everything else is the engine's."""

    def __init__(self, engine: Engine, replies: list[str] | None = None) -> None:
        self.engine = engine
        self.replies = list(replies or [])
        self.requests: list[GenerateRequest] = []

    def submit(self, request: GenerateRequest, on_event=None, **kw):
        import dataclasses

        self.requests.append(request)
        if self.replies:
            ids = self.engine.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
            request = dataclasses.replace(request, teacher_ids=tuple(ids))
        return self.engine.submit(request, on_event, **kw)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)
