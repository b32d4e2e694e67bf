"""Convert a GGUF file (llama.cpp) into an MLX model directory that ``mlx_lm.load`` reads.

Output: ``config.json``, ``model.safetensors`` (every tensor dequantized to float32 with
``gguf.quants.dequantize``), ``tokenizer.json`` (built from GGUF metadata with the
``tokenizers`` library) and ``tokenizer_config.json`` (chat template, bos/eos/pad).

Supported architectures (``general.architecture``):

- ``qwen2`` -> mlx-lm ``qwen2``. llama.cpp's converter permutes q/k rows only for the
  ``llama`` family (``LlamaModel.modify_tensors``); ``Qwen2Model`` stores HF order, so the
  weights are copied as they are. Tokenizer: byte-level BPE (``tokenizer.ggml.model ==
  "gpt2"``) from ``tokens`` + ``merges`` with the Qwen2 pre-tokenizer regex.
- ``gemma3`` -> mlx-lm ``gemma3_text``. No q/k permutation either. llama.cpp stores every
  Gemma RMSNorm weight with the ``+1`` folded in (``Gemma3Model.modify_tensors``); mlx-lm's
  ``RMSNorm`` computes ``x * (1 + w)``, so 1 is subtracted again here. Tokenizer:
  SentencePiece BPE (``tokenizer.ggml.model == "llama"``, tokens + scores) rebuilt as a
  ``tokenizers`` BPE whose merges are ranked by the merged piece's score, as llama.cpp's
  SPM tokenizer merges, with byte fallback and ``" " -> "▁"``.

GGUF lists dimensions innermost first (``ne``); numpy/HF order is the reverse, so a
``[in, out]`` GGUF weight becomes an ``(out, in)`` array.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..files import staged_dir

Progress = Callable[[int, int, str], None]

SUPPORTED_ARCHS = ("qwen2", "gemma3")

# Qwen2's pre-tokenizer split (HF tokenizer.json of Qwen2/Qwen2.5).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Used when a Gemma GGUF carries no chat template (the base models): Gemma's turn format;
# Gemma has no system role, so a system message becomes a user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# GGUF token types (llama.cpp llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class GGUFError(Exception):
    """The GGUF file is unreadable, truncated or of an unsupported architecture."""


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _open(path: Path):
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        # Touch every tensor's extent: a truncated file shows here, not mid-conversion.
        size = os.path.getsize(path)
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(f"tensor {t.name} extends past the end of the file")
    except GGUFError:
        raise
    except (ValueError, OSError, KeyError, IndexError, struct.error, TypeError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file (truncated or corrupt? {e})") from e
    return reader


# --------------------------------------------------------------------------- config


def _config(reader, arch: str, tensors: dict[str, Any], eos_ids: list[int]) -> dict:
    def a(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    vocab_size = int(tensors["token_embd.weight"].shape[1])
    n_heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    common = {
        "hidden_size": hidden,
        "num_hidden_layers": int(a("block_count")),
        "intermediate_size": int(a("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(a("attention.head_count_kv", n_heads)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(a("context_length", 32768)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "eos_token_id": eos_ids,
        "torch_dtype": "float32",
    }
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        common["bos_token_id"] = int(bos)
    if arch == "qwen2":
        return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **common}
    head_dim = int(a("attention.key_length", hidden // n_heads))
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        **common,
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": int(a("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,  # Gemma 3: 5 local layers, then 1 global
        "rope_local_base_freq": 10000.0,
    }


# --------------------------------------------------------------------------- tensors

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def hf_tensor_name(name: str, arch: str) -> str | None:
    """HF/mlx-lm name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for tensors mlx-lm does not use
    (``rope_freqs``)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        return None
    _, layer, base, kind = parts
    if base == "ffn_norm":
        # qwen2: the only pre-MLP norm; gemma3: the pre-feedforward norm of a sandwich
        hf = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
    else:
        hf = _BLOCK_NAMES.get(base)
    if hf is None:
        return None
    return f"model.layers.{layer}.{hf}.{kind}"


def _dequantize(t, arch: str) -> np.ndarray:
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    if arch == "gemma3" and t.name.endswith("norm.weight"):
        w = w - np.float32(1.0)
    return w


def _write_safetensors(path: Path, entries: list[tuple[str, Any]], produce, progress) -> None:
    """Stream tensors into a safetensors file one at a time (peak memory: one tensor).

    ``entries`` is ``[(hf_name, gguf_tensor)]``; ``produce(tensor)`` returns its float32
    array. Format: u64 header length, JSON header (offsets into the data), raw data.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, t in entries:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        nbytes = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for i, (name, t) in enumerate(entries):
            progress(i, len(entries), f"dequantizing {t.name} ({t.tensor_type.name})")
            w = produce(t)
            if list(w.shape) != header[name]["shape"]:
                raise GGUFError(f"{t.name}: shape {w.shape} != {header[name]['shape']}")
            f.write(np.ascontiguousarray(w).tobytes())


# --------------------------------------------------------------------------- tokenizer


def _bpe_tokenizer(reader):
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = _field(reader, "tokenizer.ggml.merges")
    if tokens is None or merges is None:
        raise GGUFError("GGUF has a gpt2 tokenizer without tokens or merges")
    types = types or [_NORMAL] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}  # specials too: they keep their ids
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    _add_special(tok, tokens, types, AddedToken)
    return tok


def _spm_tokenizer(reader):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    tokens = _field(reader, "tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores")
    types = _field(reader, "tokenizer.ggml.token_type")
    if tokens is None or scores is None or types is None:
        raise GGUFError("GGUF has a SentencePiece tokenizer without tokens/scores/types")
    vocab = {t: i for i, t in enumerate(tokens)}
    # SentencePiece BPE merges the adjacent pair whose merged piece scores highest;
    # as tokenizers BPE merges: every split of each normal piece into two vocab pieces,
    # ranked by the merged piece's score (ties: lower ids first).
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            ia, ib = vocab.get(a), vocab.get(b)
            if ia is not None and ib is not None:
                ranked.append((-scores[i], i, ia, ib, a, b))
    ranked.sort()
    merges = [(a, b) for *_, a, b in ranked]
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True)
    )
    prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", False))
    norms = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*norms, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    _add_special(tok, tokens, types, AddedToken)
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos_id is not None and _field(reader, "tokenizer.ggml.add_bos_token", False):
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    return tok


def _add_special(tok, tokens, types, AddedToken) -> None:
    """Control tokens become special added tokens; user-defined ones (``<tool_call>``,
    Gemma's whitespace runs) plain added tokens matched on the raw text, as llama.cpp does."""
    added = []
    for i, t in enumerate(tokens):
        if types[i] in (_CONTROL, _USER_DEFINED):
            special = types[i] == _CONTROL
            added.append((i, AddedToken(t, special=special, normalized=False)))
    tok.add_tokens([a for _, a in added])  # all are in the model vocab: they keep their ids
    for i, a in added:
        if tok.token_to_id(a.content) != i:
            raise GGUFError(f"added token {a.content!r} changed id")


def _tokenizer_files(reader, arch: str) -> tuple[Any, dict, list[int]]:
    """Build ``(tokenizers.Tokenizer, tokenizer_config dict, eos ids)`` from GGUF metadata."""
    model = _field(reader, "tokenizer.ggml.model")
    if model == "gpt2":
        tok = _bpe_tokenizer(reader)
    elif model == "llama":
        tok = _spm_tokenizer(reader)
    else:
        raise GGUFError(f"unsupported GGUF tokenizer model {model!r}")
    tokens = _field(reader, "tokenizer.ggml.tokens")

    def name(key):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return (tokens[int(i)], int(i)) if i is not None and int(i) < len(tokens) else (None, None)

    eos, eos_id = name("eos")
    bos, _ = name("bos")
    pad, _ = name("padding")
    eos_ids = [eos_id] if eos_id is not None else []
    for extra in ("<|endoftext|>", "<end_of_turn>"):  # turn ends the chat templates emit
        if extra in tokens and tokens.index(extra) not in eos_ids:
            eos_ids.append(tokens.index(extra))
    template = _field(reader, "tokenizer.chat_template")
    if template is None and arch == "gemma3":
        template = GEMMA_CHAT_TEMPLATE
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": name("unknown")[0],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    if template is not None:
        cfg["chat_template"] = template
    return tok, cfg, eos_ids


# --------------------------------------------------------------------------- entry point


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress | None = None) -> Path:
    """Convert ``gguf_path`` into the MLX model directory ``out_dir``; return ``out_dir``.

    Every tensor is dequantized to float32 (disk: 4 bytes per parameter; demo ~2.5 GB).
    Written into a temp dir next to ``out_dir`` and renamed at the end, so a killed
    conversion never leaves a half directory. ``progress(done, total, message)`` is
    called once per tensor and per file (``done`` counts steps of ``total``).

    Raises:
        GGUFError: the file is not GGUF, truncated, or its architecture/tokenizer is not
            one of :data:`SUPPORTED_ARCHS`.
    """
    report = progress or (lambda done, total, message: None)
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHS})")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{gguf_path} has no token_embd.weight tensor")
    entries = [(n, t) for t in reader.tensors if (n := hf_tensor_name(t.name, arch)) is not None]
    total = len(entries) + 2

    def complete(d: Path) -> bool:  # else another process finished the same conversion
        return (d / "config.json").exists() and (d / "model.safetensors").exists()

    with staged_dir(out_dir, complete) as tmp:
        report(0, total, "building tokenizer")
        tok, tok_cfg, eos_ids = _tokenizer_files(reader, arch)
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        config = _config(reader, arch, tensors, eos_ids)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))

        def step(i, n, message):
            report(1 + i, total, message)

        try:
            _write_safetensors(
                tmp / "model.safetensors", entries, lambda t: _dequantize(t, arch), step
            )
        except (ValueError, NotImplementedError) as e:
            raise GGUFError(f"{gguf_path}: cannot dequantize ({e})") from e
        report(total - 1, total, "finishing")
    report(total, total, "done")
    return out_dir
