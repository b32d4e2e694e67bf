"""cli/bench/shape_export.py: a ``shape:`` model written for ``mlx_lm.server`` loads through
mlx-lm as the same model tierchat builds in memory (same logits), for a dense, a hybrid, a
4-bit and a 4-bit MoE shape (cut down to a few small layers)."""

from __future__ import annotations

import copy
import importlib.util

import mlx.core as mx
import pytest
from mlx_lm.utils import load
from tierchat.cli.bench.shape_export import mlx_model_dir
from tierchat.core.models import shapes

SMALL = {
    "qwen2.5-0.5b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
    "qwen3-8b-4bit": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2),
    "qwen3-30b-a3b-4bit": dict(
        hidden_size=128, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
    "qwen3.5-0.8b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4),
}  # fmt: skip
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(shapes.DEMO_GGUF_HEADER_PACKAGE) is None,
    reason="shape: models take the demo package's tokenizer",
)


@pytest.mark.parametrize("name", list(SMALL))
def test_exported_shape_loads_as_the_same_model(name, tmp_path, models_dir, monkeypatch):
    config = copy.deepcopy(shapes.SHAPES[name])
    inner = config.get("text_config", config)
    inner.update(SMALL[name], **HEADS)
    if "text_config" in config:
        inner.update(linear_num_key_heads=2, linear_num_value_heads=2)
    monkeypatch.setitem(shapes.SHAPES, name, config)
    out = mlx_model_dir(f"shape:{name}:3", models_dir, tmp_path)
    assert out.parent == tmp_path and (out / "tokenizer.json").exists()
    assert mlx_model_dir(f"shape:{name}:3", models_dir, tmp_path) == out  # written once

    tok_dir = shapes.tokenizer_dir(models_dir)
    built = shapes.shape_config(name, shapes.eos_token_ids(tok_dir))
    ours = shapes.build_model(built, mx.float32, 3)
    theirs, tokenizer = load(str(out))
    ids = mx.array([tokenizer.encode("def f(x): return x + 1")])
    assert mx.array_equal(ours(ids), theirs(ids)).item()


def test_a_model_directory_is_returned_as_is(tmp_path, models_dir):
    out = mlx_model_dir("tiny:llama", models_dir, tmp_path)
    assert out.parent == models_dir and not any(tmp_path.iterdir())
