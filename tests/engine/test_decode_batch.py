"""The batched decode step on its own (core/engine/decode_batch.py, docs/DESIGN.md §20): a
joining sequence's token goes through the model with the batch's next step, and a sequence
removed before that step leaves with its token fed. Tiny models on the CPU in float32."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_kit import LOGPROB_TOL, random_prompt
from mlx_lm.models.cache import make_prompt_cache
from tierchat.core.engine.decode_batch import DecodeBatch
from tierchat.core.models.loading import load_model
from tierchat.core.models.tiny import TINY_ARCHS


def _filled(model, tokens):
    """A fresh cache holding ``tokens`` (one forward)."""
    cache = make_prompt_cache(model)
    model(mx.array([list(tokens)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _next_logprobs(model, cache, token):
    logits = model(mx.array([[token]]), cache=cache)[:, -1, :].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_joining_costs_no_forward_and_removal_before_a_step_feeds_the_token(arch, models_dir):
    model = load_model(f"tiny:{arch}", models_dir=models_dir).model
    a, b = random_prompt(21, seed=1), random_prompt(13, seed=2)
    batch = DecodeBatch(model)
    batch.add(1, a[-1], _filled(model, a[:-1]), list(a[:-1]), 5, [])
    # the first step feeds the joining token (its response, a repeat, is dropped); the
    # second yields the first new token
    assert batch.step() == []
    assert [s.uid for s in batch.step()] == [1]
    cache_b = _filled(model, b[:-1])
    batch.add(2, b[-1], cache_b, list(b[:-1]), 5, [])
    # the join ran nothing: b's cache still ends before its token
    offsets = [c.offset for c in cache_b if hasattr(c, "offset")]
    assert all(o == len(b) - 1 for o in offsets)  # (a pure SSM has none)
    out = batch.remove(2)
    # removed before any step: its token was fed on the way out, so what follows is
    # computed as after b whole
    probe = random_prompt(1, seed=3)[0]
    got = _next_logprobs(model, out, probe)
    whole = _next_logprobs(model, _filled(model, b), probe)
    assert float(np.abs(got - whole).max()) < LOGPROB_TOL
    # the other sequence decodes on, one token per step
    assert [s.uid for s in batch.step()] == [1]
