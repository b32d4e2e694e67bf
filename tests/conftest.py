"""Shared fixtures. ``models_dir``: where tiny and demo models are built for this session
(``$TIERCHAT_MODELS_DIR`` if set, so slow conversions can be reused across runs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tierchat.core  # noqa: F401  (preloads OpenBLAS before any test module imports mlx)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    env = os.environ.get("TIERCHAT_MODELS_DIR")
    if env:
        path = Path(env).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("models")
