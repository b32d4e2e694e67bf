"""The prefix cache: lookup, all-or-nothing restore, and store, over the resident cache,
the hot tier and the SSD tier.

A restore for a prompt of ``N`` tokens lands on one position ``P <= N - 1`` (docs/DESIGN.md §9),
or on ``N`` itself with the first token's logprobs kept from before: the resident cache of
the same prompt (:meth:`PrefixCache.restore_repeat`), or, on the folded schedule, through
the prompt's tail entry that kept them (:meth:`.planner.Planner.plan`):

- **Allowed positions.** ``P`` is a point of the prompt's prefill schedule
  (:func:`schedule_points`: multiples of the chunk size, message ends, ``N - 1``), or the
  end of an earlier sequence that the prompt continues (a prompt end or a decode end: the
  tokens after it were computed by decode, never by a chunk). The rest is then prefilled in
  the very chunks a cold run uses, so a restore at a schedule point is bit for bit the
  cold run (docs/DESIGN.md §18).
- **Restorable.** Each leaf says what it needs (:mod:`.layers`): KV leaves the slices of
  ``[0, P)``, window leaves those of ``[P - max_size, P)``, state leaves a snapshot taken at
  ``P`` exactly. A leaf is served by the *resident* cache (the live cache of the last
  request, cut back in place: no copy) when it can be cut to ``P``, else by entries: the
  prompt's chain of full blocks plus one entry hanging off the chain (a tail, checkpoint,
  sequence end or block) for the tokens after the last full block.

The furthest allowed, restorable ``P`` wins. Entries are loaded (hot first, else SSD,
promoted to hot; SSD loads are verified there), and only then is the cache filled, with one
concatenate per layer. A bad entry is evicted from both tiers and the lookup repeats: a
shorter prefix or a cold start, never a wrong restore. The restore itself is
:class:`~.restore.Restorer`'s, a collaborator given the tiers, the planner and the counters.

Everything here runs on the engine thread.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..api import (
    LookupStats,
    ResidentStats,
    SnapshotStats,
    TailStats,
    TierStats,
    WearStats,
)
from . import layers as L
from . import stats
from .admission import WritePolicy
from .blocks import (
    KIND_BLOCK,
    LOGPROBS,
    ChainHasher,
    Entry,
    EntryMeta,
    root_id,
)
from .capture import Capture
from .hot import HotTier
from .layers import Spec
from .planner import Planner
from .plans import Held, Resident, Restored
from .rates import Rates
from .request import CacheRequest, ColdRequest
from .restore import Restorer, snapshot_nbytes
from .ssd.tier import SSDTier, tier_folder
from .wear import WriteLedger


class PrefixCache:
    """Blocks, tails and checkpoints of one model over a hot and an SSD tier, plus the
    resident cache of the last request."""

    def __init__(
        self,
        *,
        fingerprint: str,
        leaves: Sequence[L.Leaf],
        spec: Spec,
        block_size: int,
        hot_bytes: int,
        ssd_dir: Path | None,
        ssd_bytes: int,
        max_tails: int = 64,
        max_checkpoints: int = 32,
        writer_queue: int = 4096,
        pin_system: bool = True,
        exact_prefix: bool = False,
        rates: Rates | None = None,
        write_budget: int = 0,
        admission: bool = True,
        model: str = "",
        flush_idle_s: float = 5.0,
    ) -> None:
        self.fingerprint = fingerprint
        # restores of models without state layers land on the exact common prefix
        # whenever it is further than the last schedule point (the folded schedule)
        self.exact_prefix = exact_prefix
        # measured prefill and SSD read rates: restore or recompute (None: always restore)
        self.rates = rates
        self.root = root_id(fingerprint)
        self._chain = ChainHasher(self.root, block_size)
        self.leaves = tuple(leaves)
        self.spec = spec
        # ((vocab,), dtype) of the first-token logprobs a prompt tail may keep (None: none)
        self.logprobs_spec = spec.get(LOGPROBS)
        self.block_size = block_size
        self.pin_system = pin_system
        self.kv = [lf for lf in leaves if lf.kind == L.KIND_KV]
        self.window = [lf for lf in leaves if lf.kind == L.KIND_WINDOW]
        self.state = [lf for lf in leaves if lf.snapshots]
        self.max_window = max((lf.max_size for lf in self.window), default=0)
        self.events: deque[tuple[int, str]] = deque(maxlen=200)
        self._seq = itertools.count(1)
        self.hot = HotTier(hot_bytes, max_tails, max_checkpoints, on_evict=self._evicted)
        self.planner = Planner(self)  # reads the tiers through this object
        self.capturer = Capture(self)
        # a request's plan (:meth:`.planner.Planner.plan`) and its entries for a span of
        # the live cache (:meth:`.capture.Capture.capture`), with their own signatures
        self.plan = self.planner.plan
        self.capture = self.capturer.capture
        self.ssd = (
            SSDTier(
                ssd_dir,
                fingerprint,
                ssd_bytes,
                writer_queue,
                on_event=self.log,
                ledger=WriteLedger(Path(ssd_dir) / "ssd-writes.json", write_budget),
                model=model,
            )
            if ssd_dir is not None
            else None
        )
        # which committed entries the SSD tier writes, and when (.admission)
        self.writes = WritePolicy(self.children, enabled=admission, idle_s=flush_idle_s)
        self.resident: Resident | None = None
        self.measuring = False  # a .request.MeasureRequest restores: reads admit nothing
        self._unsaved: list[Entry] = []
        self.counts = stats.HitCounters()
        self.lookups: dict[str, int] = dict.fromkeys(("resident", "hot", "ssd", "cold", "tail"), 0)
        self.restorer = Restorer(
            leaves=self.leaves,
            spec=spec,
            block_size=block_size,
            hot=self.hot,
            ssd=self.ssd,
            writes=self.writes,
            rates=rates,
            counts=self.counts,
            plan=self.planner.plan,
            reused=self._persist,
            on_filled=self._flush_evictions,
            log=self.log,
        )
        self._evicted_batch = [0, 0]  # [tails and checkpoints, blocks]

    # ------------------------------------------------------------------ events
    def log(self, text: str) -> None:
        self.events.append((next(self._seq), text))

    def _evicted(self, e: Entry, why: str) -> None:
        # named as the counters are: hot.evictions (blocks), tails.evictions (the rest)
        self._evicted_batch[e.kind == KIND_BLOCK] += 1
        if self.ssd is not None and self.writes.evicted(e):
            self._unsaved.append(e)  # RAM lets go of an entry not yet written

    def _flush_evictions(self) -> None:
        tails, blocks = self._evicted_batch
        if blocks or tails:
            parts = [f"{blocks} block{'s' * (blocks != 1)}"] if blocks else []
            parts += (
                [f"{tails} tail{'s' * (tails != 1)}/checkpoint{'s' * (tails != 1)}"]
                if tails
                else []
            )
            self.log("hot: evicted " + ", ".join(parts))
            self._evicted_batch = [0, 0]

    def ids(self, tokens: Sequence[int]) -> list[str]:
        """Chain ids of every full block of ``tokens`` (hashed once per block, incrementally
        across calls on growing or shared-prefix sequences)."""
        return self._chain.ids(tokens, len(tokens) // self.block_size)

    # ------------------------------------------------------------------ resident
    def set_resident(
        self,
        tokens: Sequence[int],
        caches: list[Any],
        prompt_tokens: int = 0,
        first_logprobs: Any = None,
        end_logprobs: Any = None,
    ) -> None:
        """Keep ``caches`` (holding exactly ``tokens``) live for the next request; its bytes
        count against the hot budget. ``first_logprobs`` (shape ``(vocab,)``): the
        logprobs the first reply token was sampled from, after the first
        ``prompt_tokens`` of ``tokens``; ``end_logprobs``: those after all of ``tokens``
        (:meth:`restore_repeat`)."""
        nbytes = sum(c.nbytes for c in caches)
        self.resident = Resident(
            tuple(tokens), caches, nbytes, prompt_tokens, first_logprobs, end_logprobs
        )
        self.hot.reserve(nbytes)
        self._flush_evictions()

    def take_resident(self) -> Resident | None:
        """Hand the resident cache to a request (it is modified in place from here on)."""
        r, self.resident = self.resident, None
        self.hot.reserve(0)
        return r

    def drop_resident(self) -> int:
        r = self.take_resident()
        return len(r.tokens) if r is not None else 0

    # ------------------------------------------------------------------ lookup
    # what the planner and the capture read and write (.view.TierView, .view.CaptureView)
    def find(self, entry_id: str, use_ssd: bool = True) -> EntryMeta | None:
        """The entry ``entry_id`` as a tier holds it: the hot ``Entry``, else the SSD
        tier's ``FileMeta`` (unless ``use_ssd`` is False), else None."""
        e = self.hot.peek(entry_id)
        if e is None and self.ssd is not None and use_ssd:
            return self.ssd.meta(entry_id)
        return e

    def held(self, entry_id: str, use_ssd: bool = True) -> Held | None:
        """Where ``entry_id`` is held (hot first, then SSD) and what it carries, or None."""
        e = self.find(entry_id, use_ssd)
        if e is None:
            return None
        return Held("hot" if isinstance(e, Entry) else "ssd", e.window, e.snapshot)

    def children(self, parent: str, use_ssd: bool = True) -> list[EntryMeta]:
        """Entries (hot ``Entry`` or SSD ``FileMeta``) that follow ``parent``."""
        found: dict[str, EntryMeta | None] = {
            i: self.hot.peek(i) for i in self.hot.children.get(parent, ())
        }
        if self.ssd is not None and use_ssd:
            for m in self.ssd.children_of(parent):
                found.setdefault(m.id, m)
        return [t for t in found.values() if t is not None]

    def hot_entry(self, entry_id: str, touch: bool = False) -> Entry | None:
        """The hot tier's entry ``entry_id``, or None; ``touch``: counted as a use (moved
        to the end of the LRU order)."""
        return self.hot.get(entry_id) if touch else self.hot.peek(entry_id)

    def restore_repeat(self, prompt: Sequence[int]) -> Restored | None:
        """The resident cache cut back to the whole ``prompt``, with its first token's kept
        logprobs, or None (:meth:`.restore.Restorer.repeat`); the resident cache is taken
        when it serves."""
        out = self.restorer.repeat(prompt, self.resident)
        if out is not None:
            self.take_resident()
        return out

    def begin(
        self,
        prompt: Sequence[int],
        points: Sequence[int],
        boundaries: Sequence[tuple[int, str]],
        fresh,
        max_position: int | None = None,
    ):
        """One request's cache protocol: a :class:`~.request.CacheRequest` over this cache
        (restore, per-chunk capture, first token, finish); the SSD writer waits from here
        to the first token."""
        return CacheRequest(self, prompt, points, boundaries, fresh, max_position)

    def restore(
        self,
        prompt: Sequence[int],
        ids: Sequence[str],
        points: Sequence[int],
        fresh,
        max_position: int | None = None,
    ) -> Restored:
        """Restore the furthest allowed prefix of ``prompt`` (see the module doc), at most
        ``max_position`` tokens when given (:meth:`.restore.Restorer.restore`). ``ids``: the
        prompt's chain ids (:meth:`ids`); ``points``: its schedule; ``fresh``: makes a new
        cache list (``model.make_cache``). Takes the resident cache: the returned
        ``caches`` is it (cut back in place) when it served, else a fresh list."""
        resident = self.take_resident()
        return self.restorer.restore(prompt, ids, points, resident, fresh, max_position)

    # ------------------------------------------------------------------ store
    def complete(self, caches, entries: list[Entry]) -> None:
        """Fill in what entries deferred (:meth:`.capture.Capture.complete`)."""
        self.capturer.complete(caches, entries)

    def commit(self, entries: list[Entry]) -> None:
        """Put evaluated entries into the hot tier; they reach the SSD tier at the next
        :meth:`persist` (the engine calls it once the request's first token is out)."""
        for e in entries:
            e.nbytes = sum(a.nbytes for a in e.arrays.values())
            e.snapshot_nbytes = snapshot_nbytes(e.arrays, self.state)
            self.hot.put(e, pin=self.pin_system and e.kind == KIND_BLOCK and e.role == "system")
            if self.ssd is not None and self.writes.offer(e):
                self._unsaved.append(e)
            elif self.ssd is not None and e.id not in self.hot and self.writes.evicted(e):
                # no room in RAM (the budget yields to the requests held, §11): decided
                # now as an eviction, never deferred holding arrays nobody counts
                self._unsaved.append(e)
            if e.kind != KIND_BLOCK and e.id in self.hot:
                self.counts.tail_stashes += 1
        self._flush_evictions()

    def persist(self, max_due: int | None = None, quiet_for: float = 0.0) -> int:
        """Hand the entries admitted since the last call and the deferred ones now due
        (at most ``max_due`` bytes, the engine quiet for ``quiet_for`` seconds: 0.0 while
        requests run; :meth:`.admission.WritePolicy.due`) to the SSD tier, in commit
        order; returns the bytes accepted."""
        if self.ssd is not None:
            self._unsaved += self.writes.due(max_due, quiet_for)
        unsaved, self._unsaved = self._unsaved, []
        if self.ssd is None or not unsaved:
            return 0
        before = self.ssd.bytes_queued
        self.ssd.put_many(unsaved)
        return self.ssd.bytes_queued - before

    def _persist(self, e: Entry) -> None:
        """A hot entry reused (read by a restore): admitted
        (:meth:`.admission.WritePolicy.hit`), and repaired if the SSD tier lost it."""
        if self.ssd is not None and not self.measuring and self.writes.hit(e):
            self._unsaved.append(e)

    def repair(self, e: Entry) -> None:
        """A hot entry captured again: unless admission still defers it, handed to the SSD
        tier again, which writes it only if it lost it (an SSD clear, a dropped write, a
        full disk), so a restart still finds it."""
        if self.ssd is not None and not self.writes.is_deferred(e.id):
            self._unsaved.append(e)

    # ------------------------------------------------------------------ admin
    def clear(self, tier: str) -> str:
        """Clear ``hot``, ``ssd``, ``tails``, ``all`` or ``resident``; returns a one-line
        report of what was removed from each tier. Clearing RAM (``hot``, ``all``) also
        drops the resident cache."""
        parts = []
        if tier == "resident":
            parts.append(f"resident cache of {self.drop_resident()} tokens")
        if tier == "hot" and self.ssd is not None:
            # RAM goes: what it held and the SSD tier does not is written first
            self._unsaved += self.writes.flush()
            self.persist()
        if tier in ("all", "tails"):
            for e in list(self.hot.entries()):
                if tier == "all" or e.kind != KIND_BLOCK:
                    self.writes.forget(e.id)
        if tier in ("hot", "all"):
            nbytes = self.hot.nbytes
            parts.append(f"hot {self.hot.clear()} entries ({nbytes / 2**20:.1f} MiB)")
            dropped = self.drop_resident()
            if dropped:
                parts.append(f"resident cache of {dropped} tokens")
        if tier == "tails":
            parts.append(f"hot {self.hot.clear(tails_only=True)} tails and checkpoints")
            files = 0
            if self.ssd is not None:
                for entry_id in self.ssd.tail_ids():
                    self.ssd.remove(entry_id)
                    files += 1
            parts.append(f"SSD {files} tail and checkpoint files")
        if tier in ("ssd", "all"):
            parts.append(f"SSD {self.ssd.clear() if self.ssd is not None else 0} files")
        if not parts:
            raise ValueError(f"unknown tier {tier!r}: expected hot, ssd, tails or all")
        msg = f"cleared {tier}: " + ", ".join(parts)
        self.log(msg)
        return msg

    def flush(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` seconds for the SSD writer to write what it has
        queued; what it has not written by then is dropped (counted in
        :attr:`ssd_write_drops`). Whether all of it was written. Any thread: the writer's
        own thread writes (a bounded stop, docs/DESIGN.md §15)."""
        if self.ssd is None or not self.ssd.enabled:
            return True
        if self.ssd.flush(timeout_s):
            return True
        self.ssd.drop_pending()
        return False

    @property
    def writes_queued(self) -> int:
        """Entries the SSD writer has accepted and not yet written (0 without an SSD tier)."""
        return self.ssd.queue_depth if self.ssd is not None and self.ssd.enabled else 0

    @property
    def ssd_write_drops(self) -> int:
        """SSD writes given up since start (a full queue, a bounded stop; 0 without a tier)."""
        return self.ssd.write_drops if self.ssd is not None else 0

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what was admitted and what is still deferred (:mod:`.admission`), save
        the rates, close the SSD tier (its writer writes what is queued, waiting at most
        ``timeout_s`` seconds: :meth:`.ssd.tier.SSDTier.close`). Never raises: a failure
        is logged, and the tier still closes (its lock given back)."""
        try:
            if self.ssd is not None:
                self._unsaved += self.writes.flush()
            self.persist()
            if self.rates is not None:
                self.rates.save()
        except Exception as exc:  # an exit must not abort the process (docs/DESIGN.md §8.6)
            self.log(f"SSD write failed at close: {type(exc).__name__}: {exc}")
        finally:
            if self.ssd is not None:
                self.ssd.close(timeout_s)

    def write_due_in(self, quiet_for: float = float("inf")) -> float | None:
        """Seconds until a deferred entry is due (0.0: now) if the engine, quiet for
        ``quiet_for`` seconds so far, stays so; None when none waits or the SSD writer is
        busy (its emptied queue wakes the engine): how long an idle engine may sleep
        (docs/DESIGN.md §8.6)."""
        if self.ssd is None or self.ssd.queue_depth:
            return None
        return self.writes.due_in(quiet_for)

    def write_due(self, quiet_for: float = float("inf")) -> int:
        """Hand the deferred entries now due to an idle SSD writer, a quarter of its
        pending bound at a time (one copy); returns the bytes accepted. The engine calls
        it while no request is held or waiting, ``quiet_for`` seconds after the last one
        (:data:`.admission.QUIET_S`)."""
        if self.ssd is None or self.ssd.queue_depth:
            return 0
        return self.persist(self.ssd.writer.max_pending_bytes // 4, quiet_for)

    # ------------------------------------------------------------------ the engine's calls
    # what the engine asks of the tiers, so that it never reaches into them (§2, §11)
    def begin_cold(self, fresh) -> ColdRequest:
        """A request with the cache off (:class:`~.request.ColdRequest`): it keeps nothing,
        and holds the SSD writer to its first token as a cached one does."""
        return ColdRequest(fresh, self)

    def fit_hot_budget(
        self, budget: Callable[[int, int], int], drop_resident: bool = True
    ) -> tuple[int, int] | None:
        """Set the hot tier's budget to ``budget(held, leaving)`` bytes, evicting down to
        it: ``(budget, entries evicted)``, or None if unchanged. ``held``: the bytes the
        budget counts now (the hot tier's entries and the resident cache); ``leaving``: the
        resident cache's part when ``drop_resident`` is False (a restore about to take it,
        or a finishing request's caches about to replace it), else 0. The resident cache
        is dropped when it alone exceeds the budget, unless ``drop_resident`` is False."""
        leaving = 0 if drop_resident else self.hot.reserved
        max_bytes = budget(self.ram_bytes, leaving)
        over = drop_resident and self.resident is not None and self.hot.reserved > max_bytes
        if over:
            self.log(f"resident cache of {self.drop_resident()} tokens dropped: over budget")
        if max_bytes == self.hot.max_bytes:
            return (max_bytes, 0) if over else None
        return max_bytes, self.hot.set_budget(max_bytes)

    @staticmethod
    def ssd_folder(cache_dir: Path | str, fingerprint: str) -> Path:
        """Where the SSD tier of the cache ``fingerprint`` names keeps its files."""
        return tier_folder(cache_dir, fingerprint)

    @property
    def ram_bytes(self) -> int:
        """Bytes the RAM tiers hold: the hot tier's entries and the resident cache."""
        return self.hot.nbytes + self.hot.reserved

    def bound_writes(self, max_bytes: int) -> int:
        """Bound the bytes of copies waiting for the SSD writer to ``max_bytes`` (never
        above its own bound; past it the engine waits for the disk); the bound in force,
        0 without a working SSD tier (docs/DESIGN.md §11)."""
        if self.ssd is None or not self.ssd.enabled:
            return 0
        writer = self.ssd.writer
        writer.max_pending_bytes = min(writer.max_pending_bytes, max_bytes)
        return writer.max_pending_bytes

    def ssd_warning(self) -> str | None:
        """Why the SSD tier asked for is off (a warning for the user), or None: it works,
        or none was asked for."""
        return self.ssd.reason if self.ssd is not None and not self.ssd.enabled else None

    def on_ssd_idle(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from the SSD writer's thread) each time its queue empties."""
        if self.ssd is not None:
            self.ssd.on_idle = callback

    def hold_writes(self, holder: Any) -> bool:
        """Hold the SSD writer for ``holder`` until :meth:`release_writes`
        (:meth:`.ssd.tier.SSDTier.pause`); False when there is no SSD tier."""
        if self.ssd is None:
            return False
        self.ssd.pause(holder)
        return True

    def release_writes(self, holder: Any) -> None:
        """Give up ``holder``'s hold on the SSD writer (no effect if it holds none)."""
        if self.ssd is not None:
            self.ssd.resume(holder)

    @property
    def ssd_files_written(self) -> int:
        """SSD files the writer has written since start (0 without an SSD tier)."""
        return self.ssd.saves_persisted if self.ssd is not None else 0

    @property
    def needs_prefill_rate(self) -> bool:
        """Whether the restore-or-recompute choice (:mod:`.rates`) is on, reads an SSD
        tier and has no prefill rate yet (a calibration at load would give it one)."""
        return self.ssd is not None and self.rates is not None and self.rates.prefill_tps <= 0

    @property
    def prefill_rate(self) -> float:
        """The measured prefill rate (tokens/s of whole prefills, :mod:`.rates`; kept across
        restarts), or 0.0 when none is known."""
        return self.rates.prefill_tps if self.rates is not None else 0.0

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` tokens took ``seconds``: the rate the choice uses."""
        if self.rates is not None:
            self.rates.observe_prefill(tokens, seconds)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        """A restore read ``nbytes`` of SSD files in ``seconds``: the read rate the choice
        uses (:mod:`.rates`)."""
        if self.rates is not None:
            self.rates.observe_read(nbytes, seconds)

    def release_ram(self) -> None:
        """Drop the RAM tiers' arrays now (hot tier and resident cache; the SSD tier's
        index stays readable): the engine is closing and its model goes."""
        self.hot.clear()
        self.drop_resident()

    # ------------------------------------------------------------------ stats
    def count_lookup(self, restored: Restored, prompt_tokens: int) -> None:
        """Count one request's restore by where its prefix came from (one per request:
        :class:`~tierchat.core.api.LookupStats`); a cold one is logged as a miss."""
        if not restored.position:
            self.lookups["cold"] += 1
            self.log(f"miss: nothing cached for {prompt_tokens} tokens, all prefilled")
            return
        kind, by = restored.cached_kind, restored.cached_by
        if kind.get("resident"):
            self.lookups["resident"] += 1
        else:
            self.lookups["ssd" if by.get("ssd", 0) > by.get("hot", 0) else "hot"] += 1
        self.lookups["tail"] += bool(kind.get("tail") or kind.get("checkpoint"))

    def lookup_stats(self) -> LookupStats:
        return LookupStats(**self.lookups)

    def tier_stats(
        self,
    ) -> tuple[TierStats, TierStats, TailStats, SnapshotStats, ResidentStats]:
        """The hot, SSD, tails, snapshots and resident figures (:func:`.stats.tier_stats`)."""
        return stats.tier_stats(self)

    def wear_stats(self) -> WearStats:
        """SSD bytes written and what admission deferred or skipped (docs/DESIGN.md §8.6)."""
        return stats.wear_stats(self)
