"""The executor's side of admission by memory (docs/DESIGN.md §11): each request's
footprint from the runtime, the reservations of the requests held, the verdict on a
queued request with the message of a refusal, and the cache tiers' budget, which yields
to the reservations. The policy itself is pure: :mod:`..memory.admission`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...config.settings import Settings
from ..memory import admission
from ..memory import pressure as memory_mod
from ..memory.prefill import PrefillRefused
from ..units import fmt_bytes
from .runtime import Runtime

Footprint = admission.Footprint

# the share of the limit's line that entries copied for the SSD writer may hold while they
# wait to be written (its ``max_pending_bytes``; the engine waits for the writer past it):
# entries the hot tier lets go under the limit spill there (docs/DESIGN.md §11)
WRITER_SHARE = 0.125


class MemoryGate:
    """Footprints, reservations and the tiers' budget for the executor's requests.

    ``monitor``: the engine's :class:`~..memory.pressure.MemoryMonitor`, whose level this
    gate makes count the reservations (``monitor.committed``). Engine thread only, but
    :meth:`committed_bytes` may be read from any thread (plain ints)."""

    def __init__(self, settings: Settings, monitor: memory_mod.MemoryMonitor) -> None:
        self.settings = settings
        self.monitor = monitor
        self.reservations = admission.Reservations()
        self.runtime: Runtime | None = None
        self._footprints: dict[int, Footprint | PrefillRefused] = {}
        self._waiting: set[int] = set()  # queued requests whose last verdict was "wait"
        self._queued = 0  # requests queued at the last "wait" (all stand behind it)
        self.waited = 0  # requests that waited for memory at the queue's head, since load
        self.refusals = 0  # requests refused for memory, since load
        self.writer_bytes = 0  # the SSD writer's bound on copies waiting (bound_writer)
        monitor.committed = self.committed_bytes
        monitor.waiting = self.waiting
        monitor.waited = lambda: self.waited

    # ------------------------------------------------------------------ figures
    def waiting(self) -> int:
        """Queued requests waiting for memory now: all those queued while the head of
        the queue waits (first come, first served), else 0 (any thread)."""
        return self._queued if self._waiting else 0

    @property
    def base_bytes(self) -> int:
        """What no eviction frees: the weights, and the SSD writer's queue of copies at
        its bound (:meth:`bound_writer`)."""
        rt = self.runtime
        if rt is None or rt.loaded is None:
            return 0
        return rt.weights_bytes + self.writer_bytes

    def bound_writer(self) -> None:
        """Bound the SSD writer's queue of copies to :data:`WRITER_SHARE` of the limit's
        line (never above its own bound): under a memory limit the engine waits for the
        disk rather than hold every evicted entry's copy (before: 30 MB of copies queued
        under a 25 MB limit, 16 clients of tiny:llama)."""
        rt = self.runtime
        cache = rt.cache if rt is not None else None
        line = self.monitor.limit_line()
        self.writer_bytes = 0
        if cache is not None and line > 0:
            self.writer_bytes = cache.bound_writes(int(WRITER_SHARE * line))

    def plan_line(self) -> int:
        """The line a prefill chunk is planned under (bytes): the limit's hard line less
        what the base holds beside the weights (the SSD writer's bound), so that a
        request's footprint at that chunk fits beside the base alone."""
        rt = self.runtime
        weights = rt.weights_bytes if rt is not None and rt.loaded is not None else 0
        return self.monitor.limit_line() - (self.base_bytes - weights)

    def committed_bytes(self) -> int:
        """The weights, the reservations and the cache tiers' bytes (any thread)."""
        rt = self.runtime
        cache = rt.cache if rt is not None else None
        tiers = cache.ram_bytes if cache is not None else 0
        return self.base_bytes + self.reservations.reserved_bytes + tiers

    def lines(self) -> admission.Lines:
        reading = self.monitor.read()
        return admission.Lines(
            self.monitor.hard_line(reading), self.monitor.limit_line(reading), self.base_bytes
        )

    def footprint(self, uid: int, params: Any) -> Footprint | PrefillRefused | None:
        """Request ``uid``'s footprint (``params``: its ``GenerateRequest``), planned
        against the limit's line (so its prefill schedule does not depend on what else
        runs); the refusal when no chunk fits; None with no model or no KV profile."""
        rt = self.runtime
        if rt is None or rt.loaded is None or rt.kv_profile is None:
            return None
        known = self._footprints.get(uid)
        if known is not None:
            return known
        n = len(params.prompt_ids)
        if params.teacher_ids:
            m = len(params.teacher_ids)
        else:
            ctx = rt.info.context_length
            m = (
                min(params.sampling.max_tokens, max(1, ctx - n))
                if ctx
                else params.sampling.max_tokens
            )
        try:
            fp: Footprint | PrefillRefused = rt.footprint(self.settings, n, m, self.plan_line())
        except PrefillRefused as exc:
            fp = exc
        self._footprints[uid] = fp
        return fp

    # ------------------------------------------------------------------ decisions
    def verdict(
        self, uid: int, params: Any, held: Iterable[int], queued: int = 1
    ) -> tuple[admission.Verdict, str]:
        """Whether queued request ``uid`` starts, waits or is refused, and a refusal's
        message (:func:`~..memory.admission.verdict`); ``held``: the uids of the requests
        held now (others' reservations are released first); ``queued``: the requests
        queued now (they wait behind ``uid`` when it waits)."""
        self.reservations.keep(held)
        fp = self.footprint(uid, params)
        if fp is None:
            return "start", ""
        if isinstance(fp, PrefillRefused):
            self.refusals += 1
            return "never", (
                f"prompt refused, too large for the memory limit: prefilling its "
                f"{len(params.prompt_ids):,}-token prompt needs about "
                f"{fmt_bytes(fp.estimate_bytes)} at peak even at a {fp.chunk_tokens}-token "
                f"chunk with every cache tier empty, over the memory line of "
                f"{fmt_bytes(fp.limit_bytes)}. Waiting will not help: shorten the prompt or "
                f"raise --memory-limit."
            )
        lines = self.lines()
        v = admission.verdict(fp, self.reservations, lines)
        if v == "wait":
            self.waited += uid not in self._waiting
            self._waiting.add(uid)
            self._queued = queued
        else:
            self._waiting.discard(uid)
            self.refusals += v != "start"
        return v, self._message(v, fp, lines, len(params.prompt_ids))

    def _message(self, v: str, fp: Footprint, lines: admission.Lines, n: int) -> str:
        need = (
            f"a {n:,}-token prompt and its reply need about {fmt_bytes(fp.peak_bytes)} "
            f"(K/V {fmt_bytes(fp.kv_bytes)}, prefill {fmt_bytes(fp.prefill_bytes)}) beside "
            f"{fmt_bytes(lines.base_bytes)} of weights"
        )
        if v == "never":
            return (
                f"prompt refused, too large for the memory limit: {need}, over the memory "
                f"line of "
                f"{fmt_bytes(lines.limit_line_bytes)} even with every cache tier empty. "
                f"Waiting will not help: shorten the prompt or max_tokens, or raise "
                f"--memory-limit."
            )
        if v == "busy":
            return (
                f"insufficient memory now: {need}; other programs leave this process a "
                f"memory line of {fmt_bytes(lines.line_bytes)} (of "
                f"{fmt_bytes(lines.limit_line_bytes)} under the limit). Retry later."
            )
        return ""

    # ------------------------------------------------------------------ lifecycle
    def hold(self, uid: int, params: Any) -> None:
        """Request ``uid`` starts: it reserves its footprint."""
        fp = self.footprint(uid, params)
        if isinstance(fp, Footprint):
            self.reservations.hold(uid, fp)

    def prefilled(self, uid: int) -> None:
        self.reservations.prefilled(uid)

    def release(self, uid: int) -> None:
        self.reservations.release(uid)
        self._footprints.pop(uid, None)

    def forget(self, held: Iterable[int]) -> None:
        """Drop what is kept of requests no longer held (reservations, footprints)."""
        keep = set(held)
        self.reservations.keep(keep)
        for uid in [u for u in self._footprints if u not in keep]:
            del self._footprints[uid]
        self._waiting &= keep

    def clear_footprints(self) -> None:
        """Forget every footprint (a model load: they were the old model's)."""
        self._footprints.clear()

    def tier_budget(self, configured: int, held_bytes: int, leaving_bytes: int = 0) -> int:
        """The cache tiers' budget: the pressure budget (:meth:`.MemoryMonitor.budget`),
        at most the room the reservations leave under the soft line
        (:func:`~..memory.admission.tier_room`). ``leaving_bytes``: the part of
        ``held_bytes`` on its way out (the resident cache a starting request takes or a
        finishing one replaces): not charged, and the budget keeps room for it until it
        goes, so only the other entries are evicted for the reservations."""
        monitor = self.monitor
        pressure = monitor.budget(configured, held_bytes=held_bytes, leaving_bytes=leaving_bytes)
        if self.runtime is None or monitor.limit_line() <= 0:
            return pressure
        soft_line = int(monitor.soft_fraction * monitor.ceiling())
        room = admission.tier_room(self.reservations, self.base_bytes, soft_line)
        return min(pressure, room + leaving_bytes)
