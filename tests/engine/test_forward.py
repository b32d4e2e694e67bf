"""The folded schedule's pieces: the last chunk gives the first token (core/engine/forward.py),
and short chunks' attention in plain MLX ops (core/engine/attention.py)."""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from engine_kit import assert_same, generate, make_engine, random_prompt
from mlx.utils import tree_flatten
from tierchat.core.engine.attention import (
    ALL_QUERIES,
    OFF,
    AttentionPlan,
    _fast_sdpa,
    chunk_attention,
    explicit_attention,
    mlx_softmax,
    plan_attention,
    pow_softmax,
)
from tierchat.core.engine.forward import last_logits_fn, verify_last_logits
from tierchat.core.models.tiny import TINY_ARCHS

STATE_ARCHS = {"qwen3_next", "qwen3_5", "mamba2", "falcon_h1", "baichuan_m1"}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_last_chunk_gives_the_first_token_on_models_without_state(tmp_path, models_dir, arch):
    """KV and window models: one chunk from the restore point to N, no separate forward of
    the last token; state models keep N-1 (their snapshot there serves a regenerate)."""
    engine = make_engine(f"tiny:{arch}", tmp_path, models_dir, bitwise=False, prefill_chunk=32)
    cold = make_engine(
        f"tiny:{arch}",
        tmp_path / "cold",
        models_dir,
        bitwise=False,
        prefill_chunk=32,
        no_cache=True,
    )
    try:
        prompt = random_prompt(75, seed=7)
        bounds = ((9, "system"), (40, "user"))
        a, ha = generate(cold, prompt, max_tokens=4, boundaries=bounds)
        b, hb = generate(engine, prompt, max_tokens=4, boundaries=bounds)
        assert_same(a, ha, b, hb)
        if arch in STATE_ARCHS:
            assert hb.trace.chunk_ends == (9, 32, 40, 64, 74)
        else:  # message ends are no chunk ends; the last chunk ends at N
            assert hb.trace.chunk_ends == (32, 64, 75)
        # a next turn: one chunk after the restored prompt + reply on KV models (chunks
        # count from the restore point)
        longer = prompt + b.token_ids + random_prompt(20, seed=8)
        c, hc = generate(cold, longer, max_tokens=4)
        d, hd = generate(engine, longer, max_tokens=4)
        assert_same(c, hc, d, hd)
        assert d.metrics.cached_tokens >= len(prompt)
        if arch not in STATE_ARCHS:
            assert len(hd.trace.chunk_ends) == 1 and hd.trace.chunk_ends[-1] == len(longer)
    finally:
        engine.close()
        cold.close()


def test_a_head_that_differs_is_not_folded(tmp_path, models_dir):
    engine = make_engine("tiny:llama", tmp_path, models_dir, bitwise=False)
    try:
        model = engine.loaded.model
        fn = last_logits_fn(model)
        assert fn is not None and verify_last_logits(model, fn, engine.runtime.make_cache)

        def soft_capped(tokens, cache):  # what a model with logit soft-capping would differ by
            return mx.tanh(fn(tokens, cache) / 30.0) * 30.0 + 1.0

        assert not verify_last_logits(model, soft_capped, engine.runtime.make_cache)
    finally:
        engine.close()


KV_ARCHS = [a for a in TINY_ARCHS if a not in STATE_ARCHS]


@pytest.mark.parametrize("arch", KV_ARCHS)
def test_split_last_layer_equals_the_models_own_forward(tmp_path, models_dir, arch):
    """The last layer run on L-1 tokens and then on the last one gives the model's own
    last-position logits and the same cache, on a fresh cache and after a prefix; it
    splits where that layer has a plain KV cache (a rotating window runs whole)."""
    engine = make_engine(f"tiny:{arch}", tmp_path, models_dir, bitwise=False)
    try:
        model = engine.loaded.model
        split = last_logits_fn(model, split_last_layer=True)
        assert split is not None
        tokens = mx.array([random_prompt(40, seed=3)])
        for prefix in (0, 17):
            want_cache, got_cache = engine.runtime.make_cache(), engine.runtime.make_cache()
            if prefix:
                for c in (want_cache, got_cache):
                    model(tokens[:, :prefix], cache=c)
            want = model(tokens[:, prefix:], cache=want_cache)[:, -1, :]
            got = split(tokens[:, prefix:], got_cache)
            assert float(mx.abs(got - want).max()) < 1e-5
            for a, b in zip(want_cache, got_cache, strict=True):
                assert a.offset == b.offset
                arrays = [
                    (x, y)
                    for (_, x), (_, y) in zip(
                        tree_flatten(a.state), tree_flatten(b.state), strict=True
                    )
                    if isinstance(x, mx.array)
                ]
                assert arrays
                for x, y in arrays:
                    assert x.shape == y.shape and float(mx.abs(x - y).max()) < 1e-5
        windowed = type(engine.runtime.make_cache()[-1]).__name__ == "RotatingKVCache"
        assert split.splits() == (0 if windowed else 2)
    finally:
        engine.close()


class _Layer:
    """A stand-in last layer: records the calls it gets and writes one K per position."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, mask=None, cache=None):
        self.calls.append((x.shape[1], mask))
        cache.update_and_fetch(x[:, None], x[:, None])
        return x


def test_the_split_cuts_only_a_causal_kv_call():
    """The proxy splits a call of hidden states, a causal mask (or none) and a plain
    KVCache; an array mask, another argument, a window cache or a layer with a
    length-dependent RoPE run whole, once."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE
    from tierchat.core.engine.forward import _position_dependent_rope, _SplitLastLayer

    x = mx.zeros((1, 5, 4))
    layer = _Layer()
    split = _SplitLastLayer(layer)
    out = split(x, "causal", KVCache())
    assert out.shape == (1, 1, 4) and layer.calls == [(4, "causal"), (1, None)]
    assert split.split == 1
    for args, kwargs in (
        ((mx.zeros((5, 5)), KVCache()), {}),  # an array mask
        (("causal", RotatingKVCache(max_size=8)), {}),  # a window
        (("causal", KVCache()), {"attn_scale": mx.ones((5, 1))}),  # a per-token argument
    ):
        layer = _Layer()

        def call(x, mask=None, cache=None, attn_scale=None, layer=layer):
            layer.calls.append((x.shape[1], mask if isinstance(mask, str) else "array"))
            return x

        out = _SplitLastLayer(call)(x, *args, **kwargs)
        assert out.shape == (1, 5, 4) and len(layer.calls) == 1
    block = nn.Module()
    block.rope = DynamicNTKScalingRoPE(8, 16, traditional=False, base=10000.0, factor=4.0)
    assert _position_dependent_rope(block) and not _position_dependent_rope(nn.Linear(2, 2))


def test_a_split_last_layer_folds_long_last_chunks_on_the_cpu(tmp_path, models_dir):
    """On the CPU a model whose last layer splits folds a last chunk of any length (one
    forward to N); one whose last layer is a rotating window folds only short ones."""
    prompt = random_prompt(90, seed=5)
    for arch, ends in (("qwen2", (90,)), ("llama_sliding", (89,))):
        engine = make_engine(f"tiny:{arch}", tmp_path / arch, models_dir, bitwise=False)
        cold = make_engine(
            f"tiny:{arch}", tmp_path / f"{arch}-cold", models_dir, bitwise=True, no_cache=True
        )
        try:
            a, ha = generate(cold, prompt, max_tokens=4)
            b, hb = generate(engine, prompt, max_tokens=4)
            assert_same(a, ha, b, hb)
            assert hb.trace.chunk_ends == ends
        finally:
            engine.close()
            cold.close()


def test_folded_schedule_with_quantized_kv(tmp_path, models_dir):
    """With ``kv_bits`` the folded schedule still gives the cold run's greedy tokens, but
    float rounding from other chunk shapes can move a key across a quantization step: the
    logprobs agree within 1e-3 there, not 1e-4 (measured 2.3e-4, tiny:llama, 8 bits)."""
    quantized = dict(bitwise=False, kv_bits=8, kv_group_size=32)
    engine = make_engine("tiny:llama", tmp_path, models_dir, **quantized)
    cold = make_engine("tiny:llama", tmp_path / "cold", models_dir, no_cache=True, **quantized)
    try:
        first = random_prompt(90, seed=1)
        reply = None
        for prompt in (first, None):  # a first turn, then one after its prompt + reply
            prompt = prompt or first + reply + random_prompt(70, seed=2)
            a, ha = generate(cold, prompt, max_tokens=4)
            b, hb = generate(engine, prompt, max_tokens=4)
            assert a.token_ids == b.token_ids
            for x, y in zip(ha.trace.logprobs, hb.trace.logprobs, strict=True):
                assert float(np.abs(x - y).max()) < 1e-3
            reply = b.token_ids
        assert b.metrics.cached_tokens >= 90 and hb.trace.chunk_ends == (len(prompt),)
    finally:
        engine.close()
        cold.close()


@pytest.mark.parametrize("softmax", [mlx_softmax, pow_softmax])
def test_explicit_attention_with_a_value_head_size_of_its_own(softmax):
    """DeepSeek-V2-style attention: V's head size differs from Q's and K's."""
    mx.random.seed(2)
    q, k = mx.random.normal((1, 4, 3, 24)), mx.random.normal((1, 4, 10, 24))
    v = mx.random.normal((1, 4, 10, 16))
    want = _fast_sdpa(q, k, v, scale=0.2, mask="causal")
    got = explicit_attention(q, k, v, 0.2, "causal", softmax)
    assert got.shape == want.shape == (1, 4, 3, 16)
    assert float(mx.abs(want - got).max()) < 1e-5


def test_a_model_whose_split_fails_still_folds_whole(tmp_path, models_dir, monkeypatch):
    """Where the split last layer does not check out at load, the engine folds with the
    layer whole, and on the CPU only short last chunks (the length limit is back)."""
    import tierchat.core.engine.runtime as runtime_mod

    real = runtime_mod.last_logits_fn

    def split_breaks(model, split_last_layer=False):
        fn = real(model, split_last_layer=split_last_layer)
        if not split_last_layer:
            return fn

        def broken(tokens, cache):
            raise TypeError("a layer the proxy cannot call")

        return broken

    monkeypatch.setattr(runtime_mod, "last_logits_fn", split_breaks)
    engine = make_engine("tiny:qwen2", tmp_path, models_dir, bitwise=False)
    try:
        assert engine.runtime.plan.folds and engine.runtime.plan.fold_limit == 40  # 2 layers
        b, hb = generate(engine, random_prompt(90, seed=5), max_tokens=2)
        assert hb.trace.chunk_ends == (89,)
        c, hc = generate(engine, random_prompt(90, seed=5) + b.token_ids + (7, 8, 9), 2)
        assert hc.trace.chunk_ends[-1] == 95  # a short last chunk folds
    finally:
        engine.close()


def test_pow_softmax_equals_mlx_softmax():
    mx.random.seed(1)
    scores = mx.random.normal((2, 3, 7, 50)) * 10
    scores = scores + mx.where(mx.random.uniform(shape=(7, 50)) > 0.8, -mx.inf, 0.0)
    want, got = mlx_softmax(scores), pow_softmax(scores)
    assert float(mx.abs(got - want).max()) < 1e-6
    assert float(mx.abs(got.sum(-1) - 1).max()) < 1e-5
    half = pow_softmax(scores.astype(mx.bfloat16))
    assert half.dtype == mx.bfloat16


def test_attention_plans():
    cpu = plan_attention(None, "cpu")
    assert cpu.takes(1, 4, 1, 100) and cpu.takes(1, 4, 4096, 4096)  # decode and prefill
    assert cpu.max_query == ALL_QUERIES and cpu.softmax in (pow_softmax, mlx_softmax)
    assert plan_attention(0, "cpu") is OFF and not OFF.takes(1, 4, 8, 8)
    cuda = plan_attention(None, "cuda")
    assert cuda.softmax is mlx_softmax and cuda.takes(1, 4, 512, 4096)
    assert not cuda.takes(1, 4, 1, 4096) and not cuda.takes(1, 4, 513, 4096)
    assert plan_attention(None, "metal") is OFF
    assert plan_attention(64, "metal").max_query == 64


def test_which_prefill_chunks_hold_their_scores():
    """The memory estimate counts score matrices only where a chunk's attention holds
    them: on CUDA a 16-bit chunk past the explicit path goes to cuDNN's fused kernel."""
    cuda = plan_attention(None, "cuda")
    assert not cuda.materializes(32, 2048, 78_000, 2)  # Qwen3-8B, bf16, at 78K tokens
    assert cuda.materializes(32, 2048, 78_000, 4)  # float32: MLX's fallback materializes
    assert cuda.materializes(32, 100, 2_000, 2)  # the explicit path: its scores are real
    assert not plan_attention(0, "cuda").materializes(32, 100, 2_000, 2)
    for backend in ("cpu", "metal"):
        assert plan_attention(None, backend).materializes(32, 2048, 78_000, 2)


@pytest.mark.parametrize("softmax", [mlx_softmax, pow_softmax])
@pytest.mark.parametrize("mask", ["causal", None, "array", "bool"])
def test_explicit_attention_equals_mlx_sdpa(mask, softmax):
    mx.random.seed(0)
    q = mx.random.normal((1, 8, 5, 16))
    k = mx.random.normal((1, 2, 20, 16))
    v = mx.random.normal((1, 2, 20, 16))
    m = {
        "array": mx.random.normal((5, 20)),
        "bool": mx.random.uniform(shape=(1, 1, 5, 20)) > 0.3,
    }.get(mask, mask)
    want = _fast_sdpa(q, k, v, scale=0.25, mask=m)
    got = explicit_attention(q, k, v, 0.25, m, softmax)
    assert float(mx.abs(want - got).max()) < 1e-5


def test_chunk_attention_applies_to_short_chunks_on_its_thread_only():
    calls = []

    def probe(length):
        q = mx.zeros((1, 2, length, 8))
        k = v = mx.zeros((1, 2, 40, 8))
        before = mx.fast.scaled_dot_product_attention
        out = before(q, k, v, scale=1.0, mask="causal")
        calls.append(out.shape)

    import tierchat.core.engine.attention as attention

    seen = []
    real = attention.explicit_attention

    def spy(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return real(*args, **kwargs)

    attention.explicit_attention = spy
    try:
        with chunk_attention(AttentionPlan(max_query=16)):
            probe(8)  # short: plain ops
            probe(32)  # longer than max_query: the fast kernel
            t = threading.Thread(target=probe, args=(8,), name="other")
            t.start()
            t.join()
        probe(8)  # outside the block
    finally:
        attention.explicit_attention = real
    assert seen == [threading.current_thread().name]
    assert len(calls) == 4
