"""Which model a cache dir's entries belong to, for commands that get no ``--model``.

The SSD tier's folder is named by the model's fingerprint (``<cache_dir>/<fingerprint[:16]>``),
a hash that cannot be turned back into a model. So the tier writes the model it was
opened for next to its entries, ``<cache_dir>/<fingerprint[:16]>/model.json``
(``{"model", "fingerprint"}``, 0600), and ``tierchat cache stats|clear`` without
``--model`` read them back (:func:`models_in`) instead of loading the default model,
which would show a fresh, empty folder of its own. Pure Python; reading creates nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...files import write_atomic

MODEL_FILE = "model.json"


def write_model_file(folder: Path, model: str, fingerprint: str) -> None:
    """Record ``model`` as the owner of the SSD folder ``folder`` (unless it already is).
    Raises OSError when the file cannot be written."""
    data = {"model": model, "fingerprint": fingerprint}
    path = Path(folder) / MODEL_FILE
    try:
        if json.loads(path.read_text()) == data:
            return
    except (OSError, ValueError):
        pass
    write_atomic(path, data)


def models_in(cache_dir: Path) -> list[str]:
    """The models whose SSD folders are under ``cache_dir``, sorted, each once (a model
    with several folders, e.g. other ``kv_bits``, is named once); [] when the dir does
    not exist or holds no folder with a readable :data:`MODEL_FILE`."""
    found: set[str] = set()
    try:
        folders = [p for p in Path(cache_dir).iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []
    for folder in folders:
        try:
            model = json.loads((folder / MODEL_FILE).read_text()).get("model")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(model, str) and model:
            found.add(model)
    return sorted(found)
