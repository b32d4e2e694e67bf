"""Memory readings, in bytes: MLX's allocator (``mx.get_active_memory`` /
``get_peak_memory`` / ``get_cache_memory``), the device (``mx.device_info()``:
``memory_size`` and ``max_recommended_working_set_size`` on Metal, ``total_memory`` on
CUDA, no memory key on the CPU backend) and the system (``/proc/meminfo`` + the cgroup v2
limit on Linux; ``sysctl hw.memsize`` + ``vm_stat`` on macOS). :class:`MemoryReader`
takes each source as a callable, so tests feed readings without creating real pressure.
The design: docs/DESIGN.md §11.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

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


_high_water = 0  # MLX's peak before its last reset (process_peak)


def reset_peak() -> None:
    """Start MLX's peak again (``mx.reset_peak_memory``; a request's metrics read the
    peak since its prefill began), keeping the process's own in :func:`process_peak`."""
    global _high_water
    _high_water = max(_high_water, mx.get_peak_memory())
    mx.reset_peak_memory()


def process_peak() -> int:
    """The most MLX active memory this process has held since it started (bytes),
    across :func:`reset_peak`."""
    return max(_high_water, mx.get_peak_memory())


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
