"""Prefill matmuls of quantized weights as a dequantize and a plain matmul
(core/engine/dequantized.py): only within the block, on its thread, at enough rows; the
same numbers as the quantized kernel within float rounding; counted by the prefill
estimate; and cached runs equal cold runs with it on (CUDA's default, forced here)."""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from engine_kit import LOGPROB_TOL, generate, make_engine, random_prompt
from test_scheduler import _quantized_tiny
from tierchat.core.engine import dequantized
from tierchat.core.engine.dequantized import bytes_of_largest, dequantized_matmuls


def _layer() -> nn.QuantizedLinear:
    layer = nn.QuantizedLinear(64, 96, bias=True, group_size=32, bits=4)
    layer.update(
        {"bias": mx.random.normal((96,), key=mx.random.key(2))}
    )  # a bias, so its add is checked too
    return layer


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = mx.dequantize

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dequantized.mx, "dequantize", counted)
    return calls


def test_only_inside_the_block_and_at_enough_rows(spy):
    layer = _layer()
    many = mx.random.normal((2, 20, 64), key=mx.random.key(1))  # 40 rows
    few = many[:, :3]  # 6 rows
    plain = layer(many)
    with dequantized_matmuls(32):
        inside = layer(many)
        small = layer(few)
    assert len(spy) == 1  # the 40-row call only
    after = layer(many)
    assert len(spy) == 1 and bool(mx.array_equal(after, plain))
    assert bool(mx.array_equal(small, layer(few)))  # below the rows: the kernel itself
    want = (
        many
        @ mx.dequantize(layer["weight"], layer["scales"], layer["biases"], group_size=32, bits=4).T
        + layer["bias"]
    )
    assert bool(mx.array_equal(inside, want))
    assert float(mx.abs(inside - plain).max()) < 1e-4  # the kernel's numbers, to rounding


def test_a_tied_output_projection_too(spy):
    emb = nn.QuantizedEmbedding(96, 64, group_size=32, bits=4)
    x = mx.random.normal((40, 64), key=mx.random.key(4))
    plain = emb.as_linear(x)
    with dequantized_matmuls(32):
        inside = emb.as_linear(x)
        emb.as_linear(x[:3])
    assert len(spy) == 1  # the 40-row call only
    assert bool(mx.array_equal(emb.as_linear(x), plain)) and len(spy) == 1  # outside: MLX's
    want = x @ mx.dequantize(emb["weight"], emb["scales"], emb["biases"], group_size=32, bits=4).T
    assert bool(mx.array_equal(inside, want))
    assert float(mx.abs(inside - plain).max()) < 1e-4


def test_the_block_is_per_thread_and_restores_on_exit(spy):
    layer = _layer()
    x = mx.random.normal((40, 64), key=mx.random.key(3))
    mx.eval(layer.parameters(), x)

    def elsewhere() -> None:
        with mx.stream(mx.new_stream(mx.default_device())):
            mx.eval(layer(x))

    with dequantized_matmuls(32):
        other = threading.Thread(target=elsewhere)
        other.start()
        other.join()
        assert len(spy) == 0  # the other thread ran the quantized kernel
        layer(x)
        assert len(spy) == 1
        with dequantized_matmuls(0):  # 0 changes nothing: still on
            layer(x)
        assert len(spy) == 2
        with dequantized_matmuls(64):  # an inner block's rows, then the outer's again
            layer(x)
            assert len(spy) == 2
        layer(x)
        assert len(spy) == 3
    layer(x)
    assert len(spy) == 3


def test_the_largest_weight_and_the_device_choice():
    model = nn.Sequential(_layer(), nn.Linear(96, 8))
    assert bytes_of_largest(model) == 96 * 64 * 4  # float32 scales: float32 weights
    tied = nn.Sequential(nn.QuantizedEmbedding(500, 64, group_size=32, bits=4), _layer())
    assert bytes_of_largest(tied) == 500 * 64 * 4
    assert bytes_of_largest(nn.Sequential(nn.Linear(4, 4))) == 0
    if mx.default_device().type == mx.cpu:
        assert dequantized.wanted(model) == 0  # measured on CUDA only


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_5"])  # gemma3: a tied output
def test_cached_runs_equal_cold_runs_with_dequantized_prefill(
    arch, tmp_path, models_dir, monkeypatch, spy
):
    """Forced on (16 rows) for a 4-bit model: the prefill estimate counts the dequantized
    weight; a prompt prefilled cold, then extended and regenerated from the cache, gives
    the cold engine's tokens and logprobs."""
    monkeypatch.setattr(dequantized, "wanted", lambda model: 16)
    spec = _quantized_tiny(arch, models_dir, tmp_path / "q4")
    kw = dict(prefill_chunk=32, prefill_step=16)
    cold = make_engine(spec, tmp_path / "cold", models_dir, no_cache=True, **kw)
    hot = make_engine(spec, tmp_path / "hot", models_dir, **kw)
    try:
        rt = hot.runtime
        assert rt.dequantize_rows == 16 and rt.dequantized_bytes > 0
        off = rt.__class__(**{**rt.__dict__, "dequantize_rows": 0})
        on_fp = rt.footprint(hot.settings, 200, 8, 1 << 40)
        off_fp = off.footprint(hot.settings, 200, 8, 1 << 40)
        assert on_fp.prefill_bytes == off_fp.prefill_bytes + rt.dequantized_bytes
        cold.record_logprobs = hot.record_logprobs = 6
        base = random_prompt(90, seed=5, vocab=250)
        longer = base + random_prompt(40, seed=6, vocab=250)
        spy.clear()
        for prompt in (base, longer, longer):
            a, ha = generate(cold, prompt, max_tokens=5)
            b, hb = generate(hot, prompt, max_tokens=5)
            assert a.token_ids == b.token_ids
            for x, y in zip(ha.trace.logprobs, hb.trace.logprobs, strict=True):
                assert float(np.abs(x - y).max()) < LOGPROB_TOL
        assert hb.trace.restored_position > 0
        assert spy  # the prefills dequantized
    finally:
        cold.close()
        hot.close()
