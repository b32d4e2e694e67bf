"""Shared fixtures. ``models_dir``: where tiny and demo models are built for this session
(``$TIERCHAT_MODELS_DIR`` if set, so slow conversions can be reused across runs; under
pytest-xdist one dir shared by the run's workers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# BLAS on one thread (unless set): the tiny models' matrices gain nothing from more, and
# OpenBLAS's waiting threads spin on shared cores (tests/engine/test_cache_exactness.py on
# 2 cores: 23 s user + 16 s system with its default threads, 23 s + 6 s with one, no
# slower). OpenBLAS reads it when it loads: before the import below.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import tierchat.core  # noqa: E402, F401  (preloads OpenBLAS before any test module imports mlx)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    env = os.environ.get("TIERCHAT_MODELS_DIR")
    if env:
        path = Path(env).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return path
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one dir for this run's workers (pytest-xdist, -n): workers building one model at
        # once keep the first copy published (core/files.py staged_dir, under a lock)
        path = tmp_path_factory.getbasetemp().parent / "models"
        path.mkdir(exist_ok=True)
        return path
    return tmp_path_factory.mktemp("models")


@pytest.fixture
def isolated_settings(monkeypatch, tmp_path):
    """No user config file or TIERCHAT_* env var (but the models dir) leaks into a test."""
    for key in list(os.environ):
        if key.startswith("TIERCHAT_") and key != "TIERCHAT_MODELS_DIR":
            monkeypatch.delenv(key)
    config = tmp_path / "config.toml"
    config.write_text("")
    monkeypatch.setenv("TIERCHAT_CONFIG", str(config))
    # transformers' logger keeps the stderr of the test that first imported it; once
    # capsys closed that stream, its warnings (tiny:baichuan_m1's model type) print a
    # "--- Logging error ---" traceback instead. Nothing of tierchat's.
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    yield
    hf_logging.set_verbosity(verbosity)


# Layers (docs/DESIGN.md §1): unit/ (no model), engine/ (tiny models in this process),
# system/ (subprocesses, servers, ranks, installs), tui/ (Pilot; its pty/tmux files are
# system tests), real/ (the demo models). The fast loop leaves out "slow" and "system".
# A few subprocess tests elsewhere carry @pytest.mark.system themselves (test_live_status's
# pty test, test_files's killed builds).
_SYSTEM_TUI_FILES = {
    "test_terminal_keys.py",
    "test_terminal_keys_tools.py",
    "test_default_terminal.py",
    "test_console_keys.py",
    "test_context_refusal.py",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "system" in parts or (("tui" in parts) and parts[-1] in _SYSTEM_TUI_FILES):
            item.add_marker(pytest.mark.system)
        if "real" in parts:
            item.add_marker(pytest.mark.slow)
