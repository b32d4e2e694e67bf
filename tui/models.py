"""The models the picker offers: built-in names and local MLX model directories.

Pure Python (the TUI never imports MLX): the built-in names mirror docs/DESIGN.md §3, and a local
directory counts as an MLX model when it holds ``config.json`` and ``*.safetensors``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BUILTIN_MODELS: tuple[tuple[str, str], ...] = (
    ("demo", "Qwen2.5-Coder-0.5B-Instruct · chat model (default)"),
    ("demo-gemma", "gemma-3-270m · base model, sliding window 512"),
    ("tiny:llama", "random weights · KVCache"),
    ("tiny:qwen2", "random weights · KVCache"),
    ("tiny:gemma3", "random weights · RotatingKVCache + KVCache"),
    ("tiny:llama_sliding", "random weights · RotatingKVCache + KVCache"),
    ("tiny:qwen3_next", "random weights · ArraysCache + KVCache (hybrid)"),
    ("tiny:qwen3_5", "random weights · ArraysCache + KVCache (hybrid)"),
    ("tiny:mamba2", "random weights · ArraysCache (SSM)"),
    ("tiny:falcon_h1", "random weights · CacheList(ArraysCache, KVCache)"),
    ("tiny:baichuan_m1", "random weights · CacheList(ArraysCache, Rotating/KVCache)"),
)


@dataclass(frozen=True)
class ModelChoice:
    """``spec`` is what ``engine.load_model`` takes; ``note`` says what it is."""

    spec: str
    note: str


def is_mlx_model_dir(path: Path) -> bool:
    try:
        return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    except OSError:
        return False


def local_model_dirs(*roots: Path | None, max_depth: int = 2) -> list[Path]:
    """MLX model directories under ``roots`` (down to ``max_depth``), sorted, without the
    converted built-ins (``demo``, ``demo-gemma``, ``tiny-*``: offered by name) and
    without hidden directories: a build in progress, or one that was killed, is a hidden
    temp directory (``.demo.tmp-<pid>-…``, core/files.py) that may already hold a
    ``config.json`` and a half-written ``*.safetensors``."""
    builtin_names = {spec for spec, _ in BUILTIN_MODELS if ":" not in spec}
    found: set[Path] = set()

    def walk(path: Path, depth: int) -> None:
        if is_mlx_model_dir(path):
            if not path.name.startswith("tiny-") and path.name not in builtin_names:
                found.add(path)
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(
                p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")
            )
        except OSError:
            return
        for child in children:
            walk(child, depth + 1)

    for root in roots:
        if root is not None and root.is_dir():
            walk(root, 0)
    return sorted(found)


def model_choices(
    models_dir: Path | None = None, *, test_models: bool = False
) -> list[ModelChoice]:
    """Built-ins first, then local MLX directories found under ``models_dir``. The
    random-weight ``tiny:*`` models (for tests and cache benchmarks, they talk nonsense)
    are left out unless ``test_models``; the picker still loads one typed by name."""
    choices = [
        ModelChoice(spec, note)
        for spec, note in BUILTIN_MODELS
        if test_models or not spec.startswith("tiny:")
    ]
    choices += [ModelChoice(str(p), "local MLX directory") for p in local_model_dirs(models_dir)]
    return choices
