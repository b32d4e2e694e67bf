"""tierchat.core: engine, models, prefix cache, conversations. Never imports Textual.

Importing this package loads the system OpenBLAS (Linux) with ``RTLD_GLOBAL`` before any
module imports MLX: MLX's CPU wheel then runs float32 matmuls through it (measured here:
2.6 -> 55-59 GFLOP/s, see docs/DESIGN.md §3). This module itself never imports MLX.
"""

from __future__ import annotations

import ctypes
import os
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)

openblas_loaded: str | None = None


def _preload_openblas() -> str | None:
    if sys.platform != "linux" or os.environ.get("TIERCHAT_NO_OPENBLAS"):
        return None
    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
            except OSError:
                continue
            return path
    return None


if "mlx.core" not in sys.modules:
    openblas_loaded = _preload_openblas()
