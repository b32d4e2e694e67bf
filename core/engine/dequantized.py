"""Prefill forwards of quantized weights as a dequantize and a plain matmul (docs/DESIGN.md
§7, "Quantized weights on CUDA").

mlx-lm's ``QuantizedLinear`` runs ``mx.quantized_matmul`` whatever the number of rows. On
CUDA (MLX 0.32.4, NVIDIA H200, bf16 activations, 4-bit affine weights, group 64) that
kernel takes 2.03 ms for 2,048 rows of a 4096 -> 12288 projection, where
``mx.dequantize`` and a bf16 matmul take 0.59 ms (the matmul alone 0.48 ms); a whole
2,048-token chunk of Qwen3-8B 4-bit at 0-28K tokens of context took 270-314 ms against
71-133 ms (docs/BENCHMARKS.md). With few rows (a decode step) the quantized kernel reads a
quarter of the bytes and stays the faster one: the engine turns this on for prefill
forwards only.

Within :func:`dequantized_matmuls`, on this thread, a ``QuantizedLinear`` (or a tied
output projection, ``QuantizedEmbedding.as_linear``) called on at least ``min_rows`` rows
dequantizes its weight (to the scales' dtype) and multiplies by it; every other call, and
every call outside the block, is MLX's own. The dequantized weight of
one projection is transient (``bytes_of_largest``: what the prefill estimate adds). A
cached and a cold run take the same forwards for the same chunks, so the cache's exactness
(docs/DESIGN.md §7) does not depend on the choice.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..device import device_info

# rows from which a prefill forward dequantizes: all of them. With fewer than ~150 rows
# the quantized kernel would be faster (the dequantize costs ~0.1 ms a projection), but on
# a fresh CUDA machine its first use with more than one row builds kernels for ~45 s (a
# 220-token turn of the 4-bit session on an H200; docs/DESIGN.md §7), which a prefill that
# never uses it does not pay; the engine dequantizes in prefill forwards only (decode
# steps keep the quantized kernels, core/engine/executor.py)
MIN_ROWS = 1

_local = threading.local()
_quantized_call = nn.QuantizedLinear.__call__
_quantized_as_linear = nn.QuantizedEmbedding.as_linear


def _dequantizes(x: mx.array) -> bool:
    rows = getattr(_local, "min_rows", 0)
    return bool(rows) and x.size >= rows * x.shape[-1]


def _times_weight(layer: nn.Module, x: mx.array) -> mx.array:
    """``x @ W.T`` of ``layer``'s quantized weight ``W``, dequantized first."""
    w = mx.dequantize(
        layer["weight"],
        scales=layer["scales"],
        biases=layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
    )
    return x @ w.T


def _call(self: nn.QuantizedLinear, x: mx.array) -> mx.array:
    if not _dequantizes(x):
        return _quantized_call(self, x)
    y = _times_weight(self, x)
    if "bias" in self:
        y = y + self["bias"]
    return y


def _as_linear(self: nn.QuantizedEmbedding, x: mx.array) -> mx.array:
    """A tied output projection (``QuantizedEmbedding.as_linear``), the same way."""
    return _times_weight(self, x) if _dequantizes(x) else _quantized_as_linear(self, x)


@contextlib.contextmanager
def dequantized_matmuls(min_rows: int) -> Iterator[None]:
    """Within the block, on this thread, ``QuantizedLinear`` calls and tied output
    projections (``QuantizedEmbedding.as_linear``) on at least ``min_rows`` rows (tokens x
    batch) run as a dequantize and a matmul; ``min_rows`` 0 changes nothing."""
    if not min_rows:
        yield
        return
    if nn.QuantizedLinear.__call__ is not _call:  # installed once; MLX's own outside a block
        nn.QuantizedLinear.__call__ = _call
        nn.QuantizedEmbedding.as_linear = _as_linear
    before = getattr(_local, "min_rows", 0)
    _local.min_rows = min_rows
    try:
        yield
    finally:
        _local.min_rows = before


def wanted(model: Any) -> int:
    """The ``min_rows`` for ``model`` on the default device: :data:`MIN_ROWS` where it has
    a quantized projection and the device is a CUDA GPU (where it was measured), else 0."""
    if device_info().backend != "cuda":
        return 0
    return MIN_ROWS if bytes_of_largest(model) else 0


def bytes_of_largest(model: Any) -> int:
    """Bytes of the largest ``QuantizedLinear`` or ``QuantizedEmbedding`` weight of
    ``model`` once dequantized (its scales' dtype; an embedding counts as the tied output
    projection it may be); 0 without one."""
    most = 0
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding):
            out_dim = m["weight"].shape[0]
            in_dim = m["scales"].shape[-1] * m.group_size
            most = max(most, out_dim * in_dim * m["scales"].dtype.size)
    return most
