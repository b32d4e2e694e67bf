"""Seeded random-weight tiny models for tests and cache benchmarks.

Each arch is a small mlx-lm ``ModelArgs`` config (hidden 64, 2-4 layers) chosen so that the
model's ``make_cache()`` exercises one family of mlx-lm cache classes:

==================  ==========================================================
``llama``           KVCache
``qwen2``           KVCache
``gemma3``          RotatingKVCache (window 32) + KVCache (gemma3_text)
``llama_sliding``   RotatingKVCache (window 32) + KVCache (llama ``layer_types``)
``qwen3_next``      ArraysCache (gated delta net) + KVCache
``qwen3_5``         ArraysCache (gated delta net) + KVCache (``text_config`` nested)
``mamba2``          ArraysCache only
``falcon_h1``       CacheList(ArraysCache, KVCache)
``baichuan_m1``     CacheList(ArraysCache, RotatingKVCache (window 48) / KVCache)
==================  ==========================================================

A tiny model is materialised once as an ordinary MLX model directory
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``) under
``models_dir/tiny-<arch>-<seed>/`` and then loaded like any other model directory, so
fingerprints and the tokenizer wrapper are uniform with the real models.

The tokenizer is character-level (ids 0-255 are 256 distinct characters, see
:func:`char_table`; no merges) plus the specials in :data:`SPECIAL_TOKENS`; ``<|end|>`` is
the EOS token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..files import staged_dir, temp_file

TINY_ARCHS: tuple[str, ...] = (
    "llama",
    "qwen2",
    "gemma3",
    "llama_sliding",
    "qwen3_next",
    "qwen3_5",
    "mamba2",
    "falcon_h1",
    "baichuan_m1",
)

SPECIAL_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|pad|>")
EOS_TOKEN = "<|end|>"
EOS_TOKEN_ID = 256 + SPECIAL_TOKENS.index(EOS_TOKEN)
VOCAB_SIZE = 272  # 256 bytes + 5 specials, rounded up to a multiple of 16
SLIDING_WINDOW = 32  # tokens; small so that test prompts overflow it
DEFAULT_SEED = 0

CHAT_TEMPLATE = (
    "{% if tools is defined and tools %}"
    "<|system|>Tools (to call one, answer <tool_call>\n"
    '{"name": ..., "arguments": {...}}\n</tool_call>):'
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}<|end|>"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "<|user|><tool_response>\n{{ message['content'] }}\n</tool_response><|end|>"
    "{% else %}"
    "<|{{ message['role'] }}|>"
    "{% if message.reasoning_content is defined and message.reasoning_content %}"
    "<think>\n{{ message.reasoning_content }}\n</think>\n"
    "{% endif %}"
    "{{ message['content'] }}"
    "{% if message.tool_calls is defined and message.tool_calls %}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>\n{"name": {{ tool_call.name | tojson }}, "arguments": '
    "{% if tool_call.arguments is string %}{{ tool_call.arguments }}"
    "{% else %}{{ tool_call.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}"
    "{% endif %}"
    "<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Each message as ``<|role|>content<|end|>`` (the generation prompt ``<|assistant|>``);
with tools: a ``<|system|>`` block listing them first, an assistant's ``reasoning_content``
as ``<think>`` before its content, its ``tool_calls`` as ``<tool_call>`` JSON (Hermes
form, which mlx-lm's ``json_tools`` parser reads) after it, and a ``tool`` message as a
``<|user|>`` turn holding a ``<tool_response>``. Without those fields the text is the
plain form above."""

_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 131072,  # agent-length prompts
}

_LINEAR_ATTN = {  # qwen3_next / qwen3_5 gated delta net
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "head_dim": 16,
}


def tiny_config(arch: str) -> dict[str, Any]:
    """The ``config.json`` dict of ``tiny:<arch>``.

    Raises:
        KeyError: ``arch`` is not in :data:`TINY_ARCHS`.
    """
    if arch not in TINY_ARCHS:
        raise KeyError(arch)
    base = {**_DIMS, "eos_token_id": EOS_TOKEN_ID, "tie_word_embeddings": False}
    if arch == "llama":
        cfg = {
            **base,
            "model_type": "llama",
            "num_hidden_layers": 2,
            "head_dim": 32,
        }  # 32: KV quantization groups
    elif arch == "qwen2":
        cfg = {**base, "model_type": "qwen2", "num_hidden_layers": 2}
    elif arch == "llama_sliding":
        layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
        cfg = {
            **base,
            "model_type": "llama",
            "num_hidden_layers": 3,
            "layer_types": layer_types,
            "sliding_window": SLIDING_WINDOW,
        }
    elif arch == "gemma3":
        cfg = {
            **base,
            "model_type": "gemma3_text",
            "num_hidden_layers": 4,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": SLIDING_WINDOW,
            "sliding_window_pattern": 2,  # layers 1 and 3 global, 0 and 2 sliding
        }
    elif arch == "qwen3_next":
        cfg = {
            **base,
            **_LINEAR_ATTN,
            "model_type": "qwen3_next",
            "num_hidden_layers": 4,
            "num_experts": 0,
            "num_experts_per_tok": 0,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 0,
            "mlp_only_layers": [],
            "moe_intermediate_size": 0,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        }
    elif arch == "qwen3_5":
        text = {
            **base,
            **_LINEAR_ATTN,
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 4,
            "rope_parameters": {
                "type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        }
        cfg = {"model_type": "qwen3_5", "eos_token_id": EOS_TOKEN_ID, "text_config": text}
    elif arch == "mamba2":
        cfg = {
            "model_type": "mamba2",
            "eos_token_id": EOS_TOKEN_ID,
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 8,
            "head_dim": 16,
            "state_size": 16,
            "num_hidden_layers": 2,
            "layer_norm_epsilon": 1e-5,
            "conv_kernel": 4,
            "n_groups": 1,
            "use_bias": False,
            "use_conv_bias": True,
            "tie_word_embeddings": False,
            "time_step_limit": [0.0, 1000.0],
            "time_step_rank": "auto",
        }
    elif arch == "falcon_h1":
        cfg = {
            **base,
            "model_type": "falcon_h1",
            "num_hidden_layers": 2,
            "head_dim": 16,
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 32,
            "rope_theta": 10000.0,
        }
    else:  # baichuan_m1
        cfg = {
            **base,
            "model_type": "baichuan_m1",
            "num_hidden_layers": 3,
            "rope_theta": 10000.0,
            "sliding_window": 48,
            "sliding_window_layers": [0, 2],
            "conv_window": 2,
            "num_swa_attention_heads": 4,
            "num_swa_key_value_heads": 2,
        }
    return cfg


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def char_table() -> dict[int, str]:
    """Token id -> character of the tiny tokenizer's 256 base tokens.

    Printable ASCII, tab and newline are themselves; every other id is a character from
    U+4E00 up (CJK, clear of the GPT-2 byte alphabet that tokenizer layers may remap). Each id is one character and each character one id, so any sequence of
    generated ids decodes to valid text that re-encodes to the same ids: replies always
    splice back into the next prompt exactly (a byte-level vocabulary would let random
    weights emit invalid UTF-8, which cannot round-trip through text).
    """
    return {i: chr(i) if 32 <= i < 127 or i in (9, 10) else chr(0x4E00 + i) for i in range(256)}


def char_tokenizer_json() -> str:
    """``tokenizer.json`` text of the tiny character-level tokenizer (261 tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {ch: i for i, ch in char_table().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok.to_str()


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|pad|>",
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": 1 << 20,
    }


def _init_weights(model, seed: int) -> dict[str, mx.array]:
    """Deterministic float32 weights: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1).

    Vectors (norms, biases, SSM ``A_log``/``D``/``dt_bias``) keep the model's own init
    except biases, which become small noise so they matter. The numpy generator walks the
    parameters in sorted name order, so a seed always gives the same weights.
    """
    rng = np.random.default_rng(seed)
    params = dict(tree_flatten(model.parameters()))
    out = {}
    for name in sorted(params):
        p = params[name]
        shape = tuple(p.shape)
        if name.endswith(("embed_tokens.weight", "embeddings.weight")):
            w = rng.standard_normal(shape)
        elif p.ndim >= 2:
            fan_in = int(np.prod(shape[1:]))
            w = rng.standard_normal(shape) / np.sqrt(fan_in)
        elif name.endswith(".bias"):
            w = 0.02 * rng.standard_normal(shape)
        else:
            w = np.array(p.astype(mx.float32))
        out[name] = mx.array(w.astype(np.float32))
    return out


def build_tiny_weights(arch: str, seed: int = DEFAULT_SEED) -> tuple[dict, dict[str, mx.array]]:
    """Build ``tiny:<arch>`` in memory: ``(config, weights)``, weights float32 by name.

    Raises:
        KeyError: unknown ``arch``.
    """
    from mlx_lm.utils import _get_classes

    config = tiny_config(arch)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = _init_weights(model, seed)
    return config, weights


def materialize_tiny(arch: str, models_dir: Path, seed: int = DEFAULT_SEED) -> Path:
    """Write ``tiny:<arch>`` as an MLX model dir ``models_dir/tiny-<arch>-<seed>/``; return it.

    An existing directory is reused, its ``config.json`` and ``tokenizer_config.json``
    rewritten where they differ from this code's (a dir made before the context or the
    template changed; the weights do not depend on either). Written to a temp dir and
    renamed, so a killed run never leaves a half directory.

    Raises:
        KeyError: unknown ``arch``.
    """
    models_dir = Path(models_dir)
    target = models_dir / f"tiny-{arch}-{seed}"
    if (target / "model.safetensors").exists():
        _refresh_configs(target, arch)
        return target
    config, weights = build_tiny_weights(arch, seed)
    with staged_dir(target, lambda d: (d / "model.safetensors").exists()) as tmp:
        (tmp / "tokenizer.json").write_text(char_tokenizer_json())
        for name, text in _config_texts(arch).items():
            (tmp / name).write_text(text)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    return target


def _config_texts(arch: str) -> dict[str, str]:
    """``config.json`` and ``tokenizer_config.json`` of ``tiny:<arch>``, as written."""
    return {
        "config.json": json.dumps(tiny_config(arch), indent=2, sort_keys=True),
        "tokenizer_config.json": json.dumps(_tokenizer_config(), indent=2),
    }


def _refresh_configs(target: Path, arch: str) -> None:
    for name, text in _config_texts(arch).items():
        path = target / name
        if not path.exists() or path.read_text() != text:
            with temp_file(path) as tmp:
                tmp.write_text(text)
                tmp.replace(path)


def load_tiny_tokenizer(model_dir: Path):
    """The tiny tokenizer of ``model_dir`` as an mlx-lm ``TokenizerWrapper``, with the
    ``json_tools`` tool parser that mlx-lm's ``load()`` infers from :data:`CHAT_TEMPLATE`
    (``has_tool_calling`` is True).

    Built straight from ``tokenizer.json``: ``AutoTokenizer`` would pick the tokenizer class
    from the config's ``model_type`` (e.g. ``Qwen2Tokenizer``, byte-level) and ignore the
    character-level pipeline in the file.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    cfg = _tokenizer_config()
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(Path(model_dir) / "tokenizer.json"),
        eos_token=cfg["eos_token"],
        pad_token=cfg["pad_token"],
    )
    tok.chat_template = cfg["chat_template"]
    from mlx_lm.tool_parsers import json_tools

    return TokenizerWrapper(
        tok,
        eos_token_ids=[EOS_TOKEN_ID],
        tool_parser=json_tools.parse_tool_call,
        tool_call_start=json_tools.tool_call_start,
        tool_call_end=json_tools.tool_call_end,
    )
