"""Memory pressure levels and the cache byte budget (readings: ``readings.py``; the
prefill guard: ``prefill.py``).

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

Held and reserved. A request admitted (``admission.py``) reserves what it may reach (its
K/V at full length, its prefill's scratch) before it allocates it, so the level is judged
on ``max(in_use, committed)``: ``committed`` (:attr:`MemoryMonitor.committed`, the
executor's) is the weights, the reservations of the requests held and the bytes the cache
tiers hold. Sixteen requests admitted at once read "hard" when they are admitted, not
when their prefills have grown their caches (before: "ok" at 9.8x the limit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from ..api import MemoryStats
from .readings import MemoryReader, MemoryReading, process_peak

Level = Literal["ok", "soft", "hard"]

DEFAULT_LIMIT_FRACTION = 0.90  # share of min(device, system) memory used as the default limit


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
    ``max(in_use, committed())`` (``in_use = active + cache``) against :func:`ceiling`
    (module docstring says why); ``committed`` (bytes, the executor sets it) counts what
    the requests held have reserved and the cache tiers hold, 0 by default.
    Safe to call from any thread: it only reads allocator counters and the system.
    """

    committed: Callable[[], int] = staticmethod(lambda: 0)
    waiting: Callable[[], int] = staticmethod(lambda: 0)  # requests waiting for memory
    waited: Callable[[], int] = staticmethod(lambda: 0)  # requests that waited, since load

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

    def judged(self, reading: MemoryReading) -> int:
        """The bytes a level is judged on: ``max(in_use, committed())``."""
        return max(reading.in_use, self.committed())

    def level(self, reading: MemoryReading | None = None) -> Level:
        reading = reading or self.read()
        return pressure_level(
            self.judged(reading), self.ceiling(reading), self.soft_fraction, self.hard_fraction
        )

    def limit_line(self, reading: MemoryReading | None = None) -> int:
        """``hard_fraction × limit``: the hard line of the configured (or default) limit
        alone, whatever other programs hold (bytes; 0 when no limit is known)."""
        reading = reading or self.read()
        limit = self.limit_bytes if self.limit_bytes is not None else default_limit(reading)
        return int(self.hard_fraction * limit)

    def hard_line(self, reading: MemoryReading | None = None) -> int:
        """``hard_fraction × ceiling``: the peak a new prefill must stay under (bytes).

        A :class:`HardLine` (an int) that also carries the ceiling and fraction it came
        from and the bytes in use, so a refusal can name them."""
        reading = reading or self.read()
        c = self.ceiling(reading)
        return HardLine(int(self.hard_fraction * c), c, self.hard_fraction, reading.in_use)

    def budget(
        self, configured_bytes: int, held_bytes: int, min_bytes: int = 0, leaving_bytes: int = 0
    ) -> int:
        """:func:`effective_budget` at the current readings, judged on
        ``max(in_use, committed) - leaving_bytes`` (:meth:`judged`): ``leaving_bytes`` is
        memory counted there that is on its way out (a resident cache a starting request
        takes, its bytes already in the request's reservation)."""
        reading = self.read()
        judged = max(0, self.judged(reading) - leaving_bytes)
        c = self.ceiling(reading)
        return effective_budget(
            configured_bytes,
            pressure_level(judged, c, self.soft_fraction, self.hard_fraction),
            held_bytes=held_bytes,
            in_use_bytes=judged,
            ceiling_bytes=c,
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
            level=pressure_level(self.judged(r), c, self.soft_fraction, self.hard_fraction),
            committed=self.committed(),
            process_peak=max(r.peak, process_peak()),
            waiting=self.waiting(),
            waited=self.waited(),
        )
