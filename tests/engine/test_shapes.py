"""``shape:<name>`` models (core/models/shapes.py) and the device/dtype line (core/device.py).

The real shapes are checked without computing a weight (parameter counts and cache classes
of the lazily built models); loading and generating run on shrunk configs of the same
architectures, with the real tokenizer built from the demo GGUF's header.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import mlx.core as mx
import pytest
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from tierchat.core.device import compute_dtype, describe_device, device_info, dtype_name
from tierchat.core.models import shapes
from tierchat.core.models.loading import ModelError, list_models, load_model

needs_demo = pytest.mark.skipif(
    importlib.util.find_spec(shapes.DEMO_GGUF_HEADER_PACKAGE) is None,
    reason="shape: models take the demo package's tokenizer",
)

QWEN3_SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
SMALL = {  # per shape: what shrinks it to a few MB of weights (vocab stays: the tokenizer's)
    "qwen2.5-0.5b": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "qwen3.5-0.8b": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "full_attention_interval": 2,
    },
    "qwen3-8b": QWEN3_SMALL,
    "qwen3-8b-4bit": QWEN3_SMALL,
    "qwen3-30b-a3b-4bit": {
        **QWEN3_SMALL,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
    },
    "qwen2.5-0.5b-4bit": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "llama3-70b": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "gemma3-270m": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
    },
}


def small_config(name: str) -> dict:
    config = shapes.shape_config(name)
    text = config.get("text_config", config)
    text.update(SMALL[name])
    return config


def lazy_model(config: dict):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    return model_cls(args_cls.from_dict(config))


@pytest.fixture(scope="session")
def tok_dir(models_dir):
    if importlib.util.find_spec(shapes.DEMO_GGUF_HEADER_PACKAGE) is None:
        pytest.skip("shape: models take the demo package's tokenizer")
    return shapes.tokenizer_dir(models_dir)


@pytest.fixture
def small_shapes(monkeypatch):
    """Every SHAPES entry shrunk: load_model('shape:...') builds a few-MB model."""
    for name in SMALL:
        monkeypatch.setitem(shapes.SHAPES, name, small_config(name))


# --------------------------------------------------------------------------- device


def test_describe_device_names_the_cpu_and_float32():
    if mx.default_device().type != mx.cpu:
        pytest.skip("runs where MLX computes on the CPU")
    info = device_info()
    assert (info.kind, info.backend, info.dtype) == ("cpu", "cpu", "float32")
    line = describe_device()
    assert line.startswith("cpu") and line.endswith(", float32")
    assert describe_device("bfloat16").endswith(", bfloat16")
    assert compute_dtype({"torch_dtype": "float16"}) == mx.float32  # the CPU policy wins


# --------------------------------------------------------------------------- the real shapes


def test_qwen25_05b_has_qwen25_05b_parameter_count():
    # Qwen2.5-0.5B: 494,032,768 parameters (tied embeddings): the shapes are the real ones
    assert shapes.parameter_count(shapes.shape_config("qwen2.5-0.5b")) == 494_032_768


def test_qwen3_8b_has_qwen3_8b_parameter_count():
    # Qwen3-8B: 8,190,735,360 parameters (untied lm_head); the 4-bit variant has the same
    # shapes before quantization
    for name in ("qwen3-8b", "qwen3-8b-4bit"):
        assert shapes.parameter_count(shapes.shape_config(name)) == 8_190_735_360
    model = lazy_model(shapes.shape_config("qwen3-8b"))
    attn = model.model.layers[0].self_attn
    assert (attn.n_heads, attn.n_kv_heads, attn.q_norm.weight.shape) == (32, 8, (128,))
    assert attn.rope.base == 1e6 and len(model.layers) == 36
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (12288, 4096)
    assert "lm_head" in model and model.lm_head.weight.shape == (151936, 4096)
    assert {type(c) for c in make_prompt_cache(model)} == {KVCache}


def test_qwen3_30b_a3b_has_its_parameter_count_and_experts():
    # Qwen3-30B-A3B: 30,532,122,624 parameters
    config = shapes.shape_config("qwen3-30b-a3b-4bit")
    assert shapes.parameter_count(config) == 30_532_122_624
    model = lazy_model(config)
    layer = model.model.layers[0]
    assert (layer.self_attn.n_heads, layer.self_attn.n_kv_heads) == (32, 4)
    assert layer.mlp.gate.weight.shape == (128, 2048) and layer.mlp.top_k == 8
    assert layer.mlp.switch_mlp.gate_proj.weight.shape == (128, 768, 2048)
    assert len(model.layers) == 48 and {type(c) for c in make_prompt_cache(model)} == {KVCache}
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}


def quantized_layers(model) -> dict[str, tuple[str, int, int]]:
    return {
        path: (type(m).__name__, m.bits, m.group_size)
        for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
        if hasattr(m, "bits")
    }


def test_4bit_shapes_quantize_every_layer_as_mlx_lm_convert_does():
    dense = shapes.build_model(small_config("qwen3-8b"), mx.float32, seed=3)
    q = shapes.build_model(small_config("qwen3-8b-4bit"), mx.float32, seed=3)
    got = quantized_layers(q)
    # 7 projections per layer x 2 layers, the embedding and lm_head; norms stay
    assert len(got) == 16 and set(got.values()) >= {("QuantizedLinear", 4, 64)}
    assert got["model.embed_tokens"] == ("QuantizedEmbedding", 4, 64)
    assert type(q.model.norm) is type(dense.model.norm)
    # the same seed draws the same weights: the 4-bit model is the dense one quantized
    w, scales, biases = mx.quantize(dense.model.layers[1].mlp.down_proj.weight, 64, 4)
    ql = q.model.layers[1].mlp.down_proj
    assert mx.array_equal(ql.weight, w).item() and mx.array_equal(ql.scales, scales).item()
    assert mx.array_equal(ql.biases, biases).item()
    moe = quantized_layers(shapes.build_model(small_config("qwen3-30b-a3b-4bit"), mx.float32))
    assert moe["model.layers.0.mlp.gate"] == ("QuantizedLinear", 8, 64)  # the router
    assert moe["model.layers.0.mlp.switch_mlp.up_proj"] == ("QuantizedSwitchLinear", 4, 64)


def test_llama3_70b_has_its_parameter_count_and_shapes():
    # Llama-3.3-70B: 70,553,706,496 parameters with its 128,256-token vocab; ours has the
    # Qwen2.5 tokenizer's 151,936 rows in the embedding and lm_head (2 x 23,680 x 8192 more)
    config = shapes.shape_config("llama3-70b")
    assert shapes.parameter_count(config) == 70_553_706_496 + 2 * (151_936 - 128_256) * 8192
    model = lazy_model(config)
    attn = model.model.layers[0].self_attn
    assert (attn.n_heads, attn.n_kv_heads, len(model.layers)) == (64, 8, 80)
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (28672, 8192)
    assert hasattr(model, "shard")  # tensor parallel across ranks


def _cut_rows(model) -> None:
    """A stand-in for ``model.shard(group)`` on rank 0 of 2: every projection keeps the
    first half of its output rows."""
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = getattr(layer.self_attn, name)
            proj.weight = proj.weight[: proj.weight.shape[0] // 2]


def test_a_rank_builds_its_shard_of_the_same_weights_without_the_whole_model():
    config = small_config("llama3-70b")
    whole = shapes.build_model(config, mx.float32, seed=5)
    seen = []

    def cut(model):
        # called once, on the drawn but not yet computed weights
        seen.append(model.model.layers[0].self_attn.q_proj.weight)
        _cut_rows(model)

    part = shapes.build_model(config, mx.float32, seed=5, shard=cut)
    assert len(seen) == 1
    for a, b in zip(whole.model.layers, part.model.layers, strict=True):
        w = a.self_attn.k_proj.weight
        assert mx.array_equal(b.self_attn.k_proj.weight, w[: w.shape[0] // 2]).item()
        assert mx.array_equal(b.mlp.up_proj.weight, a.mlp.up_proj.weight).item()


def test_hybrid_is_18_gated_delta_net_and_6_attention_layers():
    model = lazy_model(shapes.shape_config("qwen3.5-0.8b"))
    kinds = [type(c) for c in model.make_cache()]
    assert kinds.count(ArraysCache) == 18 and kinds.count(KVCache) == 6
    assert kinds[3::4] == [KVCache] * 6  # every 4th layer is full attention
    text = shapes.SHAPES["qwen3.5-0.8b"]["text_config"]
    assert (text["hidden_size"], text["vocab_size"]) == (1024, 151936)


def test_gemma_shape_slides_on_5_of_6_layers():
    model = lazy_model(shapes.shape_config("gemma3-270m"))
    caches = model.make_cache()
    rotating = [c for c in caches if isinstance(c, RotatingKVCache)]
    assert len(caches) == 18 and len(rotating) == 15
    assert {c.max_size for c in rotating} == {512}


@pytest.mark.parametrize(
    "spec, parsed",
    [("shape:qwen2.5-0.5b", ("qwen2.5-0.5b", 0)), ("shape:gemma3-270m:7", ("gemma3-270m", 7))],
)
def test_parse_spec(spec, parsed):
    assert shapes.parse_spec(spec) == parsed


@pytest.mark.parametrize("spec", ["shape:", "shape:llama", "shape:qwen2.5-0.5b:-1", "tiny:llama"])
def test_parse_spec_rejects(spec):
    with pytest.raises(shapes.ShapeError):
        shapes.parse_spec(spec)


# --------------------------------------------------------------------------- weights


def test_random_weights_in_the_dtype_seeded_and_scaled():
    config = small_config("qwen3.5-0.8b")
    a = dict(tree_flatten(shapes.build_model(config, mx.bfloat16, seed=1).parameters()))
    b = dict(tree_flatten(shapes.build_model(config, mx.bfloat16, seed=1).parameters()))
    c = dict(tree_flatten(shapes.build_model(config, mx.bfloat16, seed=2).parameters()))
    for name, w in a.items():
        want = mx.float32 if name.endswith("A_log") else mx.bfloat16  # as mlx-lm keeps it
        assert w.dtype == want, name
        assert mx.array_equal(w, b[name]).item(), name
    q = "language_model.model.layers.3.self_attn.q_proj.weight"
    assert not mx.array_equal(a[q], c[q]).item()
    std = mx.std(a[q].astype(mx.float32)).item()  # 1/sqrt(fan_in = 64) = 0.125
    assert 0.11 < std < 0.14
    emb = mx.std(a["language_model.model.embed_tokens.weight"].astype(mx.float32)).item()
    assert 0.018 < emb < 0.022


# --------------------------------------------------------------------------- tokenizer + load


@needs_demo
def test_tokenizer_is_the_demos_qwen25(tok_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.get_vocab_size() <= shapes.VOCAB_SIZE
    assert tok.token_to_id("<|im_end|>") in shapes.eos_token_ids(tok_dir)
    assert (
        "<|im_start|>"
        in json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"]
    )
    assert not list(tok_dir.glob("*.safetensors"))  # no weights on disk


@needs_demo
def test_tokenizer_is_copied_from_a_converted_demo(tok_dir, tmp_path):
    demo = tmp_path / "demo"
    demo.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, demo / name)
    (demo / "config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    made = shapes.tokenizer_dir(tmp_path)
    assert (made / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert shapes.eos_token_ids(made) == [151645, 151643]


@needs_demo
@pytest.mark.parametrize("name", list(SMALL))
def test_load_and_generate_two_tokens(name, tok_dir, models_dir, small_shapes):
    lm = load_model(f"shape:{name}", models_dir=models_dir)
    assert lm.dtype == dtype_name(compute_dtype())
    assert lm.extra["random_weights"] and lm.model_dir == tok_dir
    ids = list(
        lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True
        )
    )
    assert lm.tokenizer.decode(ids).startswith("<|im_start|>")
    cache = lm.make_cache()
    out = []
    logits = lm.model(mx.array([ids]), cache=cache)[0, -1]
    for _ in range(2):
        out.append(int(mx.argmax(logits).item()))
        logits = lm.model(mx.array([out[-1:]]), cache=cache)[0, -1]
    assert len(out) == 2 and all(0 <= t < shapes.VOCAB_SIZE for t in out)


@needs_demo
def test_fingerprint_covers_name_seed_and_dtype(tok_dir, models_dir, small_shapes):
    a = load_model("shape:qwen2.5-0.5b", models_dir=models_dir)
    assert a.fingerprint != load_model("shape:qwen2.5-0.5b:1", models_dir=models_dir).fingerprint
    config = a.config
    other_dtype = shapes.fingerprint("qwen2.5-0.5b", 0, config, tok_dir, "bfloat16")
    other_name = shapes.fingerprint("gemma3-270m", 0, config, tok_dir, a.dtype)
    assert len({a.fingerprint, other_dtype, other_name}) == 3
    assert a.fingerprint == shapes.fingerprint("qwen2.5-0.5b", 0, config, tok_dir, a.dtype)


def test_models_lists_the_shapes(tmp_path):
    info = {m.name: m for m in list_models(tmp_path)}
    for name in shapes.SHAPES:
        assert "random weights, for benchmarks" in info[f"shape:{name}"].note


def test_unknown_shape_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="unknown model 'shape:nope'"):
        load_model("shape:nope", models_dir=tmp_path)
