"""Which device MLX computes on, and in which dtype (docs/DESIGN.md §3, device policy).

The dtype policy lives here so that the model loader, ``tierchat config``, ``tierchat bench``
and the TUI header all name the same thing: on a GPU (Metal or CUDA) floating weights are
bf16 (fp16 where a model's config asks for it); on the CPU float32, because MLX's CPU
backend runs half-precision matmuls ~15x slower than float32 through BLAS.

Importing this module imports MLX (after ``tierchat.core`` preloaded OpenBLAS).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import mlx.core as mx

Backend = Literal["cuda", "metal", "cpu"]


class DeviceInfo(NamedTuple):
    """The default MLX device: ``kind`` "gpu" or "cpu", ``backend`` "cuda", "metal" or
    "cpu", ``name`` as ``mx.device_info()`` reports it ("" if it does not), and the
    compute ``dtype`` name ("bfloat16", "float16", "float32")."""

    kind: Literal["gpu", "cpu"]
    backend: Backend
    name: str
    dtype: str


def compute_dtype(config: dict | None = None) -> mx.Dtype:
    """The dtype floating weights are cast to on the default device.

    CPU: float32. GPU: float16 when ``config`` (a model's ``config.json``) says
    ``torch_dtype``/``dtype`` "float16", else bfloat16.
    """
    if mx.default_device().type == mx.cpu:
        return mx.float32
    config = config or {}
    wanted = str(config.get("torch_dtype") or config.get("dtype") or "")
    return mx.float16 if wanted == "float16" else mx.bfloat16


def dtype_name(dtype: mx.Dtype) -> str:
    """``mx.bfloat16`` -> "bfloat16"."""
    return str(dtype).rsplit(".", 1)[-1]


def _gpu_backend() -> Backend:
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    metal = getattr(mx, "metal", None)
    if metal is not None and metal.is_available():
        return "metal"
    return "cuda"  # a GPU device without Metal is MLX's CUDA backend


def device_info(dtype: str | None = None) -> DeviceInfo:
    """The default device and compute dtype (``dtype`` overrides the policy's, e.g. a
    loaded model's ``LoadedModel.dtype``)."""
    device = mx.default_device()
    kind: Literal["gpu", "cpu"] = "cpu" if device.type == mx.cpu else "gpu"
    backend: Backend = "cpu" if kind == "cpu" else _gpu_backend()
    try:
        name = str(mx.device_info(device).get("device_name", ""))
    except (AttributeError, RuntimeError, ValueError):  # older MLX, or no info on this device
        name = ""
    return DeviceInfo(kind, backend, name, dtype or dtype_name(compute_dtype()))


# MLX's CUDA backend runs attention through cuDNN's SDPA by default. Its decode steps (one
# query) are not reproducible: on an H100 (shape:qwen3-8b, bf16, a 256-token prompt, 40
# greedy tokens) two processes agreed on 27 of 40 tokens, and two runs in one process were
# not bit-identical either, while every op of the prefill (435 outputs: matmuls, norms,
# attention) and a teacher-forced forward were bit-identical across processes. MLX's own
# attention kernels (this variable) made both agree on 40 of 40, decoding ~5% slower
# (89-94 against 94-101 tok/s); CUDA_LAUNCH_BLOCKING=1 (38/40) and MLX_USE_CUDA_GRAPHS=0
# (29/40) did not (docs/DESIGN.md §18, scripts/gpu_determinism.py).
DETERMINISTIC_ENV: dict[str, str] = {"MLX_CUDA_USE_CUDNN_SDPA": "0"}
SET_ENV: dict[str, str] = {}  # the MLX variables this process set (peer_env leaves them out)


def use_deterministic_kernels() -> dict[str, str]:
    """Set :data:`DETERMINISTIC_ENV` (the ``bitwise`` setting on CUDA; harmless elsewhere:
    only MLX's CUDA backend reads it) unless the environment already says otherwise;
    returns what it set. MLX reads the variable at its first attention in the process, so
    this runs before any model does (the engine's constructor). Long prefill chunks then
    also leave cuDNN (slower beyond 512 tokens, docs/DESIGN.md §7)."""
    return _set_env(DETERMINISTIC_ENV)


def use_cuda_graphs(on: bool) -> dict[str, str]:
    """Set ``MLX_USE_CUDA_GRAPHS`` to ``on`` (the ``cuda_graphs`` setting) unless the
    environment already says; returns what it set. MLX reads it once, at its first CUDA
    work in the process: the engine's constructor calls this before any model runs. Only
    MLX's CUDA backend reads it."""
    return _set_env({"MLX_USE_CUDA_GRAPHS": "1" if on else "0"})


def _set_env(values: dict[str, str]) -> dict[str, str]:
    import os

    done = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(done)
    SET_ENV.update(done)
    return done


def peer_env() -> dict[str, str]:
    """This process's environment without the MLX variables tierchat set itself
    (:data:`SET_ENV`): for starting a peer (``mlx_lm.server``) as it ships."""
    import os

    return {k: v for k, v in os.environ.items() if k not in SET_ENV}


def describe_device(dtype: str | None = None) -> str:
    """One line naming the device and compute dtype, for headers and logs:
    "gpu (NVIDIA H100 80GB HBM3, cuda), bfloat16", "gpu (Apple M3 Max, metal), bfloat16",
    "cpu (AMD EPYC), float32"."""
    info = device_info(dtype)
    inside = ", ".join(p for p in (info.name, info.backend if info.kind == "gpu" else "") if p)
    where = f"{info.kind} ({inside})" if inside else info.kind
    return f"{where}, {info.dtype}"
