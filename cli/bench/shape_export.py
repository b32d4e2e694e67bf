"""A model directory ``mlx_lm.server`` can load, for the benches that drive it over HTTP
(cli/bench/serve.py, cli/bench/clients.py, cli/bench/workload_http.py; docs/DESIGN.md §17).

``tierchat`` builds a ``shape:`` model in memory and keeps only its tokenizer on disk
(core/shapes.py); ``mlx_lm.server`` loads weights from a directory. :func:`mlx_model_dir`
writes the same model (same config, seed and compute dtype, so the same weights) with
mlx-lm's own ``save_model`` and ``save_config`` beside a copy of the tokenizer files, once
per scratch directory (the benches use ``<models_dir>/shape-export/``, so a second run
reuses it; the name holds the shape's fingerprint). Every other spec is already a
directory: it is returned as is.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


EXPORT_DIR = "shape-export"  # under the models dir


def mlx_model_dir(spec: str, models_dir: Path, scratch: Path | None = None) -> Path:
    """The directory ``mlx_lm.server --model`` takes for ``spec``: a ``shape:`` model
    written under ``scratch`` (default ``models_dir/shape-export``; its weights in the
    compute dtype: 16 GB for ``shape:qwen3-8b`` in bf16), anything else where
    :func:`~tierchat.core.models.loading.resolve_model_dir` puts it.

    Raises:
        ModelError: an unknown spec (as the engine raises it).
        OSError: the scratch directory cannot be written.
    """
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model
    from tierchat.core.device import compute_dtype, dtype_name
    from tierchat.core.models import shapes
    from tierchat.core.models.loading import resolve_model_dir

    source = resolve_model_dir(spec, models_dir)
    scratch = Path(models_dir) / EXPORT_DIR if scratch is None else scratch
    if not spec.startswith("shape:"):
        return source
    name, seed = shapes.parse_spec(spec)
    config = shapes.shape_config(name, shapes.eos_token_ids(source))
    dtype = compute_dtype(config)
    digest = shapes.fingerprint(name, seed, config, source, dtype_name(dtype))[:12]
    out = Path(scratch) / f"{name}-seed{seed}-{dtype_name(dtype)}-{digest}"
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    model = shapes.build_model(config, dtype, seed)
    save_model(out, model, donate_model=True)
    del model
    gc.collect()
    mx.clear_cache()
    for file in TOKENIZER_FILES:
        shutil.copyfile(source / file, out / file)
    save_config(dict(config), out / "config.json")  # last: it marks the directory done
    return out
