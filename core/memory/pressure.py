"""Memory readings, pressure levels, the cache byte budget and the prefill guard.

The design: docs/DESIGN.md §11.

Every size here is in bytes.

Readings come from MLX's allocator (``mx.get_active_memory`` / ``get_peak_memory`` /
``get_cache_memory``), the device (``mx.device_info()``: ``memory_size`` and
``max_recommended_working_set_size`` on Metal, ``total_memory`` on CUDA, no memory key on
the CPU backend) and the system (``/proc/meminfo`` + the cgroup v2 limit on Linux;
``sysctl hw.memsize`` + ``vm_stat`` on macOS). :class:`MemoryReader` takes each source as a
callable, so tests feed readings without creating real pressure.

Levels. The memory this process *holds* is ``in_use = active + cache`` (MLX's live arrays:
weights, KV caches, the hot tier; plus MLX's pool of freed buffers, which is ours until
``mx.clear_cache()``). It is judged against a *ceiling*::

    ceiling = min(limit, in_use + system_available)

``limit`` is ``--memory-limit`` or :func:`default_limit`; ``in_use + system_available`` is
how far this process could grow before the machine runs out, so another program filling
RAM lowers the ceiling without its memory being counted as ours. Then ``in_use / ceiling``
>= ``hard_fraction`` is "hard", >= ``soft_fraction`` is "soft", else "ok". Why not
``system used = total - available``: it counts other programs' memory (a browser, the page
cache on macOS where ``vm_stat``'s free + inactive + speculative undercounts what can be
reclaimed), so a busy desktop would sit at "soft" forever with nothing of ours to shed; and
why not ``in_use`` against ``limit`` alone: it would ignore a machine that is really full.
Python objects outside MLX (tokenizer, SQLite) are not counted.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx

from ..api import MemoryStats
from ..units import fmt_bytes, fmt_bytes_exact

Level = Literal["ok", "soft", "hard"]

DEFAULT_LIMIT_FRACTION = 0.90  # share of min(device, system) memory used as the default limit
KV_STEP = 256  # tokens: mlx-lm KVCache / QuantizedKVCache / RotatingKVCache grow in steps of this
HIDDEN_COPIES = 12  # (chunk, hidden) activations alive at once: residual, norms, q, o, attn out...
KV_LAYER_COPIES = 2  # one layer's K/V copied while a cache grows (concatenate + slice update)
STATE_SCRATCH_COPIES = 8  # (h, s, s) matrices of one SSD / delta-rule step: decay, CB, product...
STATE_MIXER_COPIES = 16  # (chunk, hidden)-sized activations of a recurrent mixer (conv, gates)
STATE_STEP = 256  # tokens: mlx-lm ssm_attn processes a chunk in steps of this
SCRATCH_MARGIN = 1.10  # on everything above active_bytes: fitted on CPU, see tests/test_memory.py
MLP_COPIES = 3  # (chunk, intermediate) activations: gate, up and their SwiGLU product

MlxSource = Callable[[], tuple[int, int, int]]
DeviceSource = Callable[[], Mapping[str, Any]]
SystemSource = Callable[[], tuple[int, int]]


# ------------------------------------------------------------------ readings


@dataclass(frozen=True)
class MemoryReading:
    """One set of readings, in bytes. ``device_total`` / ``device_recommended`` are 0 when
    the backend reports none (the CPU backend); ``system_*`` are 0 when unreadable."""

    active: int = 0
    peak: int = 0
    cache: int = 0
    device_total: int = 0
    device_recommended: int = 0
    system_total: int = 0
    system_available: int = 0

    @property
    def in_use(self) -> int:
        """MLX active + cache memory: what this process holds (see the module docstring)."""
        return self.active + self.cache


def mlx_memory() -> tuple[int, int, int]:
    """``(active, peak, cache)`` bytes from MLX's allocator."""
    return mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory()


def device_memory(info: Mapping[str, Any]) -> tuple[int, int]:
    """``(total, recommended)`` bytes from an ``mx.device_info()`` dict; 0 for absent keys.

    Keys (mlx 0.32 ``mlx/backend/gpu/device_info.h``): ``memory_size`` (Metal) or
    ``total_memory`` (CUDA); ``max_recommended_working_set_size`` (Metal only: what macOS
    lets the GPU keep resident). The CPU backend reports only ``device_name`` and
    ``architecture``.
    """
    total = info.get("memory_size") or info.get("total_memory") or 0
    recommended = info.get("max_recommended_working_set_size") or 0
    return int(total), int(recommended)


def parse_meminfo(text: str) -> tuple[int, int]:
    """``(total, available)`` bytes from Linux ``/proc/meminfo`` text (values in kB).

    ``MemAvailable`` (Linux >= 3.14) is the kernel's estimate of memory usable without
    swapping; older kernels fall back to MemFree + Buffers + Cached.
    """
    fields = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key.strip()] = int(parts[0]) * 1024
    total = fields.get("MemTotal", 0)
    if "MemAvailable" in fields:
        available = fields["MemAvailable"]
    else:
        available = sum(fields.get(k, 0) for k in ("MemFree", "Buffers", "Cached"))
    return total, available


def parse_vm_stat(text: str) -> int:
    """Available bytes from macOS ``vm_stat`` output: (free + inactive + speculative) pages
    × the page size named in its first line (``(page size of 16384 bytes)``)."""
    m = re.search(r"page size of (\d+) bytes", text)
    page = int(m.group(1)) if m else 4096
    pages = 0
    for name in ("free", "inactive", "speculative"):
        m = re.search(rf"^Pages {name}:\s+(\d+)", text, re.MULTILINE)
        if m:
            pages += int(m.group(1))
    return pages * page


def _cgroup_memory(root: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """``(limit, current)`` of this process's cgroup v2, or None when unlimited/unreadable."""
    try:
        with open(os.path.join(root, "memory.max")) as f:
            raw = f.read().strip()
        if raw == "max":
            return None
        with open(os.path.join(root, "memory.current")) as f:
            return int(raw), int(f.read().strip())
    except (OSError, ValueError):
        return None


def system_memory() -> tuple[int, int]:
    """``(total, available)`` bytes of system RAM; ``(0, 0)`` when it cannot be read.

    Linux: ``/proc/meminfo`` MemTotal / MemAvailable, each lowered to the cgroup v2
    ``memory.max`` / ``memory.max - memory.current`` when a container limit is set.
    macOS: ``sysctl -n hw.memsize`` and :func:`parse_vm_stat`.
    """
    try:
        if sys.platform == "darwin":
            total = int(
                subprocess.run(
                    ["sysctl", "-n", "hw.memsize"],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=5,
                ).stdout.strip()
            )
            vm = subprocess.run(
                ["vm_stat"], capture_output=True, text=True, check=True, timeout=5
            ).stdout
            return total, min(total, parse_vm_stat(vm))
        with open("/proc/meminfo") as f:
            total, available = parse_meminfo(f.read())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0, 0
    cg = _cgroup_memory()
    if cg is not None:
        limit, current = cg
        total, available = min(total, limit), min(available, max(0, limit - current))
    return total, available


class MemoryReader:
    """Reads :class:`MemoryReading` from three injectable sources.

    ``mlx() -> (active, peak, cache)``, ``device_info() -> dict`` (read once: the device does
    not change) and ``system() -> (total, available)`` (re-read at most every
    ``system_ttl_s`` seconds by ``clock``, since on macOS it runs two subprocesses).
    """

    def __init__(
        self,
        mlx: MlxSource = mlx_memory,
        device_info: DeviceSource = mx.device_info,
        system: SystemSource = system_memory,
        *,
        system_ttl_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._mlx, self._device_info, self._system = mlx, device_info, system
        self._ttl, self._clock = system_ttl_s, clock
        self._device: tuple[int, int] | None = None
        self._sys: tuple[float, tuple[int, int]] | None = None

    def read(self) -> MemoryReading:
        active, peak, cache = self._mlx()
        if self._device is None:
            try:
                self._device = device_memory(self._device_info())
            except Exception:  # noqa: BLE001 - an unreadable device is "unknown", never fatal
                self._device = (0, 0)
        now = self._clock()
        if self._sys is None or now - self._sys[0] >= self._ttl:
            got = self._system()
            if got[0] <= 0 and self._sys is not None:  # unreadable now (EMFILE...): keep
                got = self._sys[1]  # the last good reading rather than "nothing known"
            self._sys = (now, got)
        total, available = self._sys[1]
        return MemoryReading(active, peak, cache, *self._device, total, available)


# ------------------------------------------------------------------ levels


def default_limit(reading: MemoryReading) -> int:
    """The default memory limit: ``DEFAULT_LIMIT_FRACTION`` (90%) of the smaller of device
    memory and system RAM (whichever are known), and never above Metal's recommended working
    set. 0 when nothing is known (then every level is "ok": nothing to judge against)."""
    known = [x for x in (reading.device_total, reading.system_total) if x > 0]
    if not known:
        return 0
    limit = int(DEFAULT_LIMIT_FRACTION * min(known))
    if reading.device_recommended > 0:
        limit = min(limit, reading.device_recommended)
    return limit


def ceiling(reading: MemoryReading, limit: int) -> int:
    """``min(limit, in_use + system_available)``: what this process may grow to (bytes).

    The second term is dropped when system availability is unknown (0 total)."""
    if reading.system_total > 0:
        return min(limit, reading.in_use + reading.system_available)
    return limit


def pressure_level(
    in_use: int, ceiling_bytes: int, soft_fraction: float, hard_fraction: float
) -> Level:
    """ "hard" if ``in_use >= hard_fraction × ceiling``, "soft" if ``>= soft_fraction ×
    ceiling``, else "ok" ("ok" when the ceiling is unknown, i.e. <= 0)."""
    if ceiling_bytes <= 0:
        return "ok"
    if in_use >= hard_fraction * ceiling_bytes:
        return "hard"
    if in_use >= soft_fraction * ceiling_bytes:
        return "soft"
    return "ok"


def should_clear_mlx_cache(level: str) -> bool:
    """Whether to call ``mx.clear_cache()``: at "soft" and "hard" (docs/DESIGN.md §11). MLX keeps
    freed buffers for reuse; under pressure they are the cheapest memory to give back."""
    return level != "ok"


def effective_budget(
    configured_bytes: int,
    level: str,
    *,
    held_bytes: int,
    in_use_bytes: int,
    ceiling_bytes: int,
    soft_fraction: float = 0.80,
    min_bytes: int = 0,
) -> int:
    """The shared byte budget of the hot tier + MRU tails + checkpoints at ``level``.

    - "ok": ``configured_bytes``.
    - "soft": shrink so that the process falls back under the soft line:
      ``held_bytes - (in_use_bytes - soft_fraction × ceiling_bytes)``, i.e. what the cache
      holds now minus the excess over the soft line, clamped to
      ``[min_bytes, configured_bytes]``. ``held_bytes`` is what the cache holds now (part of
      ``in_use_bytes``). Read ``in_use_bytes`` after ``mx.clear_cache()``
      (:func:`should_clear_mlx_cache`) so freed buffers are not charged to the cache.
    - "hard": ``min_bytes`` (default 0; pinned entries are the cache's business).

    The caller evicts lowest priority first down to the returned number.
    """
    floor = max(0, min(min_bytes, configured_bytes))
    if level == "ok":
        return configured_bytes
    if level == "hard":
        return floor
    excess = in_use_bytes - soft_fraction * ceiling_bytes
    return int(max(floor, min(configured_bytes, held_bytes - max(0.0, excess))))


class HardLine(int):
    """The hard line in bytes, with ``ceiling_bytes``, ``fraction`` and ``in_use_bytes``
    (weights, caches and pool at the reading) for messages."""

    ceiling_bytes: int
    fraction: float
    in_use_bytes: int

    def __new__(cls, value: int, ceiling_bytes: int, fraction: float, in_use_bytes: int):
        line = super().__new__(cls, value)
        line.ceiling_bytes, line.fraction, line.in_use_bytes = ceiling_bytes, fraction, in_use_bytes
        return line


class MemoryMonitor:
    """Pressure levels and the stats snapshot over a :class:`MemoryReader`.

    ``limit_bytes`` None → :func:`default_limit` of each reading. Levels are judged on
    ``in_use = active + cache`` against :func:`ceiling` (module docstring says why).
    Safe to call from any thread: it only reads allocator counters and the system.
    """

    def __init__(
        self,
        limit_bytes: int | None = None,
        soft_fraction: float = 0.80,
        hard_fraction: float = 0.92,
        reader: MemoryReader | None = None,
    ) -> None:
        if not 0 < soft_fraction < hard_fraction <= 1:
            raise ValueError(f"need 0 < soft ({soft_fraction}) < hard ({hard_fraction}) <= 1")
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"memory limit must be positive, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.soft_fraction = soft_fraction
        self.hard_fraction = hard_fraction
        self.reader = reader or MemoryReader()

    def read(self) -> MemoryReading:
        return self.reader.read()

    def ceiling(self, reading: MemoryReading | None = None) -> int:
        """The bytes levels are judged against (see :func:`ceiling`)."""
        reading = reading or self.read()
        limit = self.limit_bytes if self.limit_bytes is not None else default_limit(reading)
        return ceiling(reading, limit)

    def level(self, reading: MemoryReading | None = None) -> Level:
        reading = reading or self.read()
        return pressure_level(
            reading.in_use, self.ceiling(reading), self.soft_fraction, self.hard_fraction
        )

    def hard_line(self, reading: MemoryReading | None = None) -> int:
        """``hard_fraction × ceiling``: the peak a new prefill must stay under (bytes).

        A :class:`HardLine` (an int) that also carries the ceiling and fraction it came
        from and the bytes in use, so a refusal can name them."""
        reading = reading or self.read()
        c = self.ceiling(reading)
        return HardLine(int(self.hard_fraction * c), c, self.hard_fraction, reading.in_use)

    def budget(self, configured_bytes: int, held_bytes: int, min_bytes: int = 0) -> int:
        """:func:`effective_budget` at the current level and readings."""
        reading = self.read()
        return effective_budget(
            configured_bytes,
            self.level(reading),
            held_bytes=held_bytes,
            in_use_bytes=reading.in_use,
            ceiling_bytes=self.ceiling(reading),
            soft_fraction=self.soft_fraction,
            min_bytes=min_bytes,
        )

    def stats(self) -> MemoryStats:
        """One snapshot; ``limit`` is the ceiling the level was judged against."""
        r = self.read()
        c = self.ceiling(r)
        return MemoryStats(
            active=r.active,
            peak=r.peak,
            cache=r.cache,
            limit=c,
            device_total=r.device_total,
            system_total=r.system_total,
            system_available=r.system_available,
            level=pressure_level(r.in_use, c, self.soft_fraction, self.hard_fraction),
        )


# ------------------------------------------------------------------ KV per token


@dataclass(frozen=True)
class KVProfile:
    """How a model's prompt cache grows, measured from a fresh cache's shapes (bytes).

    ``per_token``: bytes per token of the layers that grow without bound (``KVCache``,
    ``QuantizedKVCache``, unknown kinds, conservatively). ``windows``: one
    ``(bytes_per_token, max_size)`` per ``RotatingKVCache``. ``fixed``: ``ArraysCache``
    state (SSM conv + recurrent state), the same at any length.
    """

    per_token: int = 0
    windows: tuple[tuple[int, int], ...] = ()
    fixed: int = 0

    @property
    def max_per_token(self) -> int:
        """Bytes per token while no window is full: an upper bound on growth per token."""
        return self.per_token + sum(b for b, _ in self.windows)

    def nbytes(self, tokens: int, chunk_tokens: int | None = None) -> int:
        """Cache bytes after prefilling ``tokens`` tokens in chunks of ``chunk_tokens``: exact
        when the last chunk is a full one, else an upper bound (the most held during it).

        Growing layers hold ``tokens`` rounded up to :data:`KV_STEP` (mlx-lm preallocates
        256-token steps, ``KVCache.update_and_fetch``); a ``RotatingKVCache`` fed S > 1
        tokens holds up to ``max_size - 1 + S`` (``_update_concat``: "the largest size is
        self.max_size + S - 1"), ``chunk_tokens`` None meaning one chunk of ``tokens``.
        """
        if tokens <= 0:
            return 0
        s = tokens if chunk_tokens is None else min(chunk_tokens, tokens)
        window = sum(b * min(tokens, m - 1 + s) for b, m in self.windows)
        return self.per_token * _round_up(tokens, KV_STEP) + window + self.fixed


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _leaf_caches(caches: Any) -> list[Any]:
    out = []
    for c in caches:
        inner = getattr(c, "caches", None)  # CacheList
        out.extend(_leaf_caches(inner) if isinstance(inner, (list, tuple)) else [c])
    return out


def _allocated_tokens(c: Any) -> int:
    """Token slots allocated in a KV-like cache (axis 2 of its keys), 0 when empty."""
    keys = getattr(c, "keys", None)
    if isinstance(keys, (list, tuple)):  # QuantizedKVCache: (packed, scales, biases)
        keys = keys[0]
    return int(keys.shape[2]) if keys is not None else 0


def kv_profile(
    model: Any, cache_factory: Callable[[Any], list] | None = None, probe_tokens: int = 2
) -> KVProfile:
    """Measure :class:`KVProfile` by prefilling ``probe_tokens`` tokens (id 0) into a fresh
    cache from ``cache_factory(model)`` (default ``mlx_lm.models.cache.make_prompt_cache``).

    Per-token bytes come from shapes, ``nbytes / allocated slots``, not from differencing
    totals, so the 256-token preallocation does not distort them. ``ArraysCache`` (no
    ``keys``) counts as ``fixed``; a ``RotatingKVCache`` (has ``max_size``) as a window;
    anything else with ``keys`` as growing. Runs the model: call it on the engine thread.
    """
    if cache_factory is None:
        from mlx_lm.models.cache import make_prompt_cache as cache_factory
    caches = cache_factory(model)
    model(mx.zeros((1, probe_tokens), dtype=mx.int32), cache=caches)
    mx.eval([c.state for c in caches])
    per_token, windows, fixed = 0, [], 0
    for c in _leaf_caches(caches):
        nbytes = int(c.nbytes)
        slots = _allocated_tokens(c)
        if not hasattr(c, "keys") or slots == 0:
            fixed += nbytes
        elif getattr(c, "max_size", None):
            windows.append((math.ceil(nbytes / slots), int(c.max_size)))
        else:
            per_token += math.ceil(nbytes / slots)
    return KVProfile(per_token, tuple(windows), fixed)


def kv_bytes_per_token(model: Any, cache_factory: Callable[[Any], list] | None = None) -> int:
    """Bytes the prompt cache grows by per token (:attr:`KVProfile.max_per_token`): exact
    for models of ``KVCache`` layers, an upper bound while window layers are full (they stop
    growing at their window), 0 for ``ArraysCache``-only models."""
    return kv_profile(model, cache_factory).max_per_token


# ------------------------------------------------------------------ prefill estimate


def estimate_prefill_peak(
    *,
    active_bytes: int,
    new_tokens: int,
    kv_bytes_per_token: int,
    chunk_tokens: int,
    n_heads: int,
    context_tokens: int,
    vocab_size: int,
    hidden_size: int,
    dtype_bytes: int,
    intermediate_size: int | None = None,
    n_layers: int = 1,
    logits_tokens: int | None = None,
    kv_new_bytes: int | None = None,
    kv_context_bytes: int | None = None,
    extra_bytes: int = 0,
) -> int:
    """Estimated peak MLX active memory (bytes) while prefilling ``new_tokens`` tokens onto
    a cache that ends up holding ``context_tokens`` (cached prefix + new tokens).

    The largest chunk is the last one: ``c = min(chunk_tokens, new_tokens)`` queries over
    ``T = context_tokens`` keys. With ``r(n)`` = n rounded up to 256 (mlx-lm ``KVCache.step``)::

        peak = active_bytes                 weights, restored caches, hot tier: as read now
             + kv_new                       kv_bytes_per_token × (r(T) - r(T - new_tokens)),
                                            or ``kv_new_bytes`` (KVProfile.nbytes: windows)
             + 1.10 × ( scores              c × T × (n_heads × dtype_bytes + 1): one layer's
                                            attention scores + bool mask, which the CPU SDPA
                                            fallback materializes (Metal's fused prefill
                                            kernel does not: an upper bound there)
                      + activations         c × (12 × hidden + 3 × intermediate) × dtype_bytes:
                                            residual, norms, q/k/v/o of one chunk; gate, up
                                            and the SwiGLU product
                      + kv_copy             2 × kv_context / n_layers: one layer's K/V copied
                                            when the cache grows a step (concatenate, then the
                                            slice update), kv_context = kv_bytes_per_token ×
                                            r(T) or ``kv_context_bytes``
                      + logits )            logits_tokens × vocab_size × dtype_bytes
             + extra_bytes

    ``logits_tokens`` defaults to ``c``: mlx-lm's lm_head runs on every position of a chunk
    and ``logits[:, -1]`` does not prune it. A loop that evaluates only the cache state
    (``mx.eval([c.state for c in cache])``, as mlx-lm ``generate_step`` and our engine do)
    never computes a chunk's logits: pass 1 (the first decode step). ``intermediate_size``
    defaults to 4 × hidden. The copy counts and the 1.10 margin were fitted to
    ``mx.get_peak_memory()`` on the CPU backend, float32 (tests/test_memory.py compares
    them with measured peaks: measured <= estimate).
    """
    if new_tokens <= 0:
        return active_bytes + extra_bytes
    c = min(chunk_tokens, new_tokens)
    t = max(context_tokens, new_tokens)
    if kv_new_bytes is None:
        kv_new_bytes = kv_bytes_per_token * (
            _round_up(t, KV_STEP) - _round_up(t - new_tokens, KV_STEP)
        )
    if kv_context_bytes is None:
        kv_context_bytes = kv_bytes_per_token * _round_up(t, KV_STEP)
    inter = intermediate_size if intermediate_size is not None else 4 * hidden_size
    scores = c * t * (n_heads * dtype_bytes + 1)
    activations = c * (HIDDEN_COPIES * hidden_size + MLP_COPIES * inter) * dtype_bytes
    kv_copy = KV_LAYER_COPIES * kv_context_bytes // max(1, n_layers)
    logits = (c if logits_tokens is None else logits_tokens) * vocab_size * dtype_bytes
    scratch = SCRATCH_MARGIN * (scores + activations + kv_copy + logits)
    return int(active_bytes + kv_new_bytes + scratch + extra_bytes)


@dataclass(frozen=True)
class ModelDims:
    """What :func:`estimate_prefill_peak` needs to know about a model."""

    n_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    n_layers: int = 1
    state_heads: int = 0


def _config_fields(model: Any) -> dict[str, Any]:
    """The model's config as a dict: ``args`` or ``config`` of the model or its inner
    ``model``, with a nested ``text_config`` merged over it (Qwen3.5, Gemma 3 VLM)."""
    fields: dict[str, Any] = {}
    for owner in (model, getattr(model, "model", None)):
        for name in ("args", "config"):
            cfg = getattr(owner, name, None)
            if cfg is not None and hasattr(cfg, "__dict__") and not fields:
                fields = dict(vars(cfg))
    text = fields.get("text_config")
    if isinstance(text, dict):
        fields = {**fields, **text}
    elif text is not None and hasattr(text, "__dict__"):
        fields = {**fields, **vars(text)}
    return fields


def model_dims(model: Any) -> ModelDims:
    """Read :class:`ModelDims` from an mlx-lm model's config (see :func:`_config_fields`).

    Missing fields fall back to weights: vocab from the largest embedding-like matrix,
    heads to ``hidden // 64``; the activation dtype is that of the first floating parameter.
    ``state_heads`` is the head count of Mamba2-style SSD layers (Mamba2 ``num_heads``,
    Falcon-H1 ``mamba_n_heads``, Nemotron-H ``mamba_num_heads``), 0 for other models.
    """
    from mlx.utils import tree_flatten

    fields = _config_fields(model)
    params = tree_flatten(model.parameters())
    floats = [v for _, v in params if v.dtype in (mx.float32, mx.float16, mx.bfloat16)]
    dtype_bytes = floats[0].dtype.size if floats else 4
    hidden = int(fields.get("hidden_size") or fields.get("d_model") or 0)
    vocab = int(fields.get("vocab_size") or 0)
    if not vocab or not hidden:
        mats = [v.shape for _, v in params if v.ndim == 2]
        big = max(mats, key=lambda s: s[0], default=(0, 0))
        vocab, hidden = vocab or big[0], hidden or big[1]
    heads = int(
        fields.get("num_attention_heads") or fields.get("num_heads") or max(1, hidden // 64)
    )
    inter = int(fields.get("intermediate_size") or 4 * hidden)
    layers = getattr(model, "layers", None) or ()
    n_layers = len(layers) or int(fields.get("num_hidden_layers") or 1)
    state_heads = int(fields.get("mamba_n_heads") or fields.get("mamba_num_heads") or 0)
    if not state_heads and "num_attention_heads" not in fields:  # Mamba2: heads are SSD heads
        state_heads = int(fields.get("num_heads") or 0)
    return ModelDims(heads, hidden, inter, vocab, dtype_bytes, n_layers, state_heads)


def estimate_for_model(
    model: Any,
    profile: KVProfile,
    *,
    active_bytes: int,
    new_tokens: int,
    context_tokens: int,
    chunk_tokens: int,
    logits_tokens: int | None = None,
    extra_bytes: int = 0,
) -> int:
    """:func:`estimate_prefill_peak` with dims from :func:`model_dims` and the KV growth
    from ``profile`` (window layers bounded by their window).

    Models with recurrent state (``profile.fixed > 0``) add
    ``1.10 × (8 × s² × state_heads × 4 + 16 × c × hidden × dtype_bytes)`` bytes,
    ``s = min(c, 256)``: one scan step of mlx-lm's SSD (``models/ssm.py`` ``ssm_attn``
    builds several ``(h, s, s)`` float32 matrices per 256-token step) and the recurrent
    mixer's own projections of one chunk (conv, gates). Fitted to the tiny hybrids on CPU.
    """
    d = model_dims(model)
    if profile.fixed > 0 and new_tokens > 0:  # recurrent layers
        c, s = min(chunk_tokens, new_tokens), min(chunk_tokens, new_tokens, STATE_STEP)
        ssd = STATE_SCRATCH_COPIES * s * s * d.state_heads * 4
        mixer = STATE_MIXER_COPIES * c * d.hidden_size * d.dtype_bytes
        extra_bytes += int(SCRATCH_MARGIN * (ssd + mixer))
    start = max(0, context_tokens - new_tokens)
    kv_new = max(
        0, profile.nbytes(context_tokens, chunk_tokens) - profile.nbytes(start, chunk_tokens)
    )
    return estimate_prefill_peak(
        active_bytes=active_bytes,
        new_tokens=new_tokens,
        kv_bytes_per_token=profile.per_token,
        chunk_tokens=chunk_tokens,
        n_heads=d.n_heads if (profile.per_token or profile.windows) else 0,  # no attention
        context_tokens=context_tokens,
        vocab_size=d.vocab_size,
        hidden_size=d.hidden_size,
        dtype_bytes=d.dtype_bytes,
        intermediate_size=d.intermediate_size,
        n_layers=d.n_layers,
        logits_tokens=logits_tokens,
        kv_new_bytes=kv_new,
        kv_context_bytes=profile.nbytes(context_tokens, chunk_tokens),
        extra_bytes=extra_bytes,
    )


# ------------------------------------------------------------------ prefill guard


class PrefillRefused(Exception):
    """A prefill whose estimated peak would cross the memory limit, even at the smallest
    chunk. The message names the estimate, the limit and what is really over it: when the
    weights and caches already in memory cross the line, no shorter prompt helps, and the
    message says so. The numbers are in ``estimate_bytes``, ``limit_bytes``,
    ``chunk_tokens`` (the smallest chunk tried) and ``in_use_bytes`` (None: not known)."""

    def __init__(
        self,
        estimate_bytes: int,
        limit_bytes: int,
        chunk_tokens: int,
        new_tokens: int | None = None,
        in_use_bytes: int | None = None,
    ) -> None:
        self.estimate_bytes, self.limit_bytes = estimate_bytes, limit_bytes
        self.chunk_tokens, self.new_tokens = chunk_tokens, new_tokens
        if in_use_bytes is None:
            in_use_bytes = getattr(limit_bytes, "in_use_bytes", None)
        self.in_use_bytes = in_use_bytes
        what = f"{new_tokens:,} new tokens" if new_tokens is not None else "this prompt"
        ceiling_bytes = getattr(limit_bytes, "ceiling_bytes", None)
        fraction = getattr(limit_bytes, "fraction", None)
        if ceiling_bytes is not None and fraction is not None:
            line = (
                f"the memory limit line of {fmt_bytes_exact(limit_bytes)} "
                f"({fraction:.0%} of the {fmt_bytes_exact(ceiling_bytes)} limit)"
            )
        else:
            line = f"the memory limit of {fmt_bytes_exact(limit_bytes)}"
        if in_use_bytes is not None and in_use_bytes >= limit_bytes:
            text = (
                f"prompt refused: the model's weights and caches already use "
                f"{fmt_bytes(in_use_bytes)}, over {line}, before any prefill. A shorter "
                f"prompt will not help: raise --memory-limit, clear cache tiers (hot, tails) "
                f"or use a smaller model."
            )
        else:
            held = (
                f" ({fmt_bytes(in_use_bytes)} of it weights and caches already in memory)"
                if in_use_bytes is not None
                else ""
            )
            text = (
                f"prompt refused: prefilling {what} would need about "
                f"{fmt_bytes(estimate_bytes)} at peak{held} (at a {chunk_tokens}-token "
                f"chunk), over {line}. Try a shorter prompt (fewer or shorter messages), a "
                f"smaller prefill chunk / --block-size, clearing cache tiers (hot, tails) to "
                f"free memory, or a higher --memory-limit."
            )
        super().__init__(text)


def plan_prefill(
    estimate_fn: Callable[[int], int],
    limit: int,
    chunk_tokens: int,
    min_chunk: int = 32,
    *,
    block_size: int | None = None,
    new_tokens: int | None = None,
) -> tuple[int, int]:
    """Pick the largest prefill chunk whose estimated peak fits under ``limit`` (bytes).

    Tries ``chunk_tokens``, then halves it down to ``min_chunk``, skipping sizes that are
    neither a divisor nor a multiple of ``block_size`` (chunk ends must stay on block
    boundaries). ``estimate_fn(chunk) -> bytes``. Returns ``(chunk, estimate)``.

    Raises:
        PrefillRefused: no chunk fits; carries the smallest chunk's estimate.
    """
    chunk, tried = chunk_tokens, None
    while chunk >= max(1, min_chunk):
        if block_size is None or block_size % chunk == 0 or chunk % block_size == 0:
            est = estimate_fn(chunk)
            if est <= limit:
                return chunk, est
            tried = (chunk, est)
        chunk //= 2
    if tried is None:
        tried = (chunk_tokens, estimate_fn(chunk_tokens))
    raise PrefillRefused(tried[1], limit, tried[0], new_tokens)
