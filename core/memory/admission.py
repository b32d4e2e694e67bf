"""Admission by memory: what each request held may reach, and whether the next one may
start now, must wait, or can never fit. Pure Python (no MLX): the engine passes the
footprints and lines in, tests pass numbers. Sizes in bytes. The design: docs/DESIGN.md
§11 ("Admission"), §20.

A request holds at most its :class:`Footprint`: its K/V at full length (prompt +
``max_tokens``) for as long as it is held, and while in prefill its prefill's scratch
(:func:`~.prefill.estimate_for_model` above the K/V, at its planned chunk). One prefill
forward runs at a time, so the scratch of the requests in prefill counts once, the
largest. A request joining the decode batch has the batch's caches copied once
(``core/engine/batch_kv.py``: each row written once into one new array, left-padded to
the longest row), so at a join the K/V of the requests held is there twice; a group of two or more
requests in prefill (``core/engine/prefill_batch.py``) merges their caches the same way,
beside its forward's scratch. One of these happens at a time. :class:`Reservations`
sums the requests held::

    reserved = kv + max(kv, largest prefill_bytes in prefill + group)
    kv = sum(kv_bytes of the requests held)
    group = sum(kv_bytes of those in prefill) when two or more are, else 0

:func:`verdict` judges the next request against the hard line (``hard_fraction`` x the
ceiling, :class:`~.pressure.MemoryMonitor`) with the cache tiers counted as free: the hot
tier and the resident cache give way (:func:`tier_room` is their budget, under the soft
line), so bytes they hold are never "used" for admission. ``base_bytes`` is what nothing evicts (the
weights). Then:

- ``"start"``: ``base + reserved + the request's footprint <= line``;
- ``"wait"``: it does not fit now, but requests held will release theirs (it stays
  queued, and no later request passes it: first come, first served);
- ``"busy"``: it would fit under the configured limit, but other programs hold the memory
  (the ceiling is below the limit) and none of ours is held to release: a 503 with
  ``Retry-After``;
- ``"never"``: alone, with empty tiers, it crosses the limit's line: no wait helps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["start", "wait", "busy", "never"]


@dataclass(frozen=True)
class Footprint:
    """What one request may hold (bytes): ``kv_bytes`` its K/V at full length (prompt +
    ``max_tokens``, :meth:`~.prefill.KVProfile.nbytes`), ``prefill_bytes`` its prefill's
    scratch above that K/V (activations, attention scores, a layer's K/V copy) at the
    planned ``chunk`` (tokens)."""

    kv_bytes: int
    prefill_bytes: int = 0
    chunk: int = 0

    @property
    def peak_bytes(self) -> int:
        """The most it holds at once, alone: its K/V and its prefill's scratch (or a
        second copy of its K/V as it joins a batch)."""
        return self.kv_bytes + max(self.prefill_bytes, self.kv_bytes)


@dataclass(frozen=True)
class Lines:
    """What :func:`verdict` judges against (bytes): ``line_bytes`` the hard line now
    (``hard_fraction`` x the ceiling, lowered when other programs fill the machine),
    ``limit_line_bytes`` the hard line of the configured limit alone, ``base_bytes`` what
    no eviction frees (the weights)."""

    line_bytes: int
    limit_line_bytes: int
    base_bytes: int = 0


class Reservations:
    """The footprints of the requests held, by uid (see the module docstring). Mutated on
    the engine thread; :attr:`reserved_bytes` is a plain int any thread may read."""

    def __init__(self) -> None:
        self._held: dict[int, Footprint] = {}
        self._prefill: set[int] = set()
        self.kv_bytes = 0  # the K/V at full length of every request held
        self.scratch_bytes = 0  # the largest prefill scratch of those in prefill (0: none)
        self.group_bytes = 0  # the K/V of those in prefill, when two or more are (a group)
        self.reserved_bytes = 0  # see the module docstring

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, uid: int) -> bool:
        return uid in self._held

    def hold(self, uid: int, footprint: Footprint) -> None:
        """Request ``uid`` starts: it holds ``footprint``, in prefill."""
        self._held[uid] = footprint
        self._prefill.add(uid)
        self._sum()

    def prefilled(self, uid: int) -> None:
        """Request ``uid``'s prefill is done: its scratch no longer counts."""
        self._prefill.discard(uid)
        self._sum()

    def release(self, uid: int) -> None:
        """Request ``uid`` ended (finished, cancelled, failed): it holds nothing."""
        self._held.pop(uid, None)
        self._prefill.discard(uid)
        self._sum()

    def keep(self, uids: Iterable[int]) -> None:
        """Release every request not in ``uids`` (the requests held now)."""
        keep = set(uids)
        for uid in [u for u in self._held if u not in keep]:
            self.release(uid)

    def _sum(self) -> None:
        self.kv_bytes = sum(f.kv_bytes for f in self._held.values())
        prefill = [self._held[u] for u in self._prefill]
        self.scratch_bytes = max((f.prefill_bytes for f in prefill), default=0)
        self.group_bytes = sum(f.kv_bytes for f in prefill) if len(prefill) > 1 else 0
        self.reserved_bytes = _reserved(self.kv_bytes, self.scratch_bytes, self.group_bytes)

    def with_(self, footprint: Footprint) -> int:
        """:attr:`reserved_bytes` once a request of ``footprint`` starts too."""
        in_prefill = [self._held[u].kv_bytes for u in self._prefill] + [footprint.kv_bytes]
        group = sum(in_prefill) if len(in_prefill) > 1 else 0
        scratch = max(self.scratch_bytes, footprint.prefill_bytes)
        return _reserved(self.kv_bytes + footprint.kv_bytes, scratch, group)


def _reserved(kv: int, scratch: int, group: int) -> int:
    return kv + max(kv, scratch + group)


def verdict(footprint: Footprint, reservations: Reservations, lines: Lines) -> Verdict:
    """Whether a request of ``footprint`` starts now, waits, or is refused (the module
    docstring gives each case); the cache tiers count as free. No limit known
    (``limit_line_bytes`` 0): "start"."""
    if lines.limit_line_bytes <= 0:
        return "start"
    if lines.base_bytes + footprint.peak_bytes > lines.limit_line_bytes:
        return "never"
    if lines.base_bytes + reservations.with_(footprint) <= lines.line_bytes:
        return "start"
    return "wait" if len(reservations) else "busy"


def tier_room(reservations: Reservations, base_bytes: int, line_bytes: int) -> int:
    """The bytes the cache tiers (hot tier, tails, checkpoints, resident cache) may hold:
    ``line_bytes`` less the base and the requests' reservations, at least 0. The engine
    passes the *soft* line: tiers that filled up to the hard line would read "hard" and be
    emptied at the next fit (docs/DESIGN.md §11)."""
    return max(0, line_bytes - base_bytes - reservations.reserved_bytes)
