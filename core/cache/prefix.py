"""The prefix cache: lookup, all-or-nothing restore, and store, over the resident cache,
the hot tier and the SSD tier.

A restore for a prompt of ``N`` tokens lands on one position ``P <= N - 1`` (docs/DESIGN.md §9),
or on ``N`` itself with the first token's logprobs kept from before: the resident cache of
the same prompt (:meth:`PrefixCache.restore_repeat`), or, on the folded schedule, through
the prompt's tail entry that kept them (:meth:`PrefixCache.plan`):

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
shorter prefix or a cold start, never a wrong restore.

Everything here runs on the engine thread.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

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
    KIND_TAIL,
    LOGPROBS,
    ChainHasher,
    Entry,
    root_id,
)
from .capture import Capture
from .hot import HotTier
from .layers import Spec
from .planner import Planner
from .plans import Held, Plan, Resident, Restored
from .rates import Rates
from .request import CacheRequest, ColdRequest
from .ssd.tier import SSDTier
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
        self._expected_by_flags = {
            (w, s): {
                k: v
                for lf in self.kv + (self.window if w else []) + (self.state if s else [])
                for k, v in spec.items()
                if k.startswith(lf.name + ".")
            }
            for w in (False, True)
            for s in (False, True)
        }
        self.events: deque[tuple[int, str]] = deque(maxlen=200)
        self._seq = itertools.count(1)
        self.hot = HotTier(hot_bytes, max_tails, max_checkpoints, on_evict=self._evicted)
        self.planner = Planner(self)  # reads the tiers through this object
        self.capturer = Capture(self)
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
        # counters
        self.hot_hits = self.hot_misses = 0
        self.resident_hits = 0
        self.tail_stashes = self.tail_hits = self.tail_misses = self.tail_tokens_saved = 0
        self.checkpoint_hits = 0
        self.lookups: dict[str, int] = dict.fromkeys(("resident", "hot", "ssd", "cold", "tail"), 0)
        self.restore_errors = 0
        self._ssd_read = 0  # bytes of SSD files the current restore read
        # ids the current restore read from SSD files (promoted to hot as they came: a
        # retry after a bad entry finds them there, and they still count as SSD tokens)
        self._ssd_loaded: set[str] = set()
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
    def held(self, entry_id: str, use_ssd: bool = True) -> Held | None:
        """Where ``entry_id`` is held (hot first, then SSD) and what it carries, or None."""
        e = self.hot.peek(entry_id)
        if e is not None:
            return Held("hot", e.window, e.snapshot)
        if self.ssd is not None and use_ssd:
            m = self.ssd.meta(entry_id)
            if m is not None:
                return Held("ssd", m.window, m.snapshot)
        return None

    def children(self, parent: str, use_ssd: bool = True) -> list:
        """Entries (hot ``Entry`` or SSD ``FileMeta``) that follow ``parent``."""
        found = {i: self.hot.peek(i) for i in self.hot.children.get(parent, ())}
        if self.ssd is not None and use_ssd:
            for m in self.ssd.children_of(parent):
                found.setdefault(m.id, m)
        return [t for t in found.values() if t is not None]

    def plan(self, *args, **kwargs) -> Plan | None:
        """The restore plan for a prompt (:meth:`.planner.Planner.plan`)."""
        return self.planner.plan(*args, **kwargs)

    def _fetch(self, entry_id: str) -> tuple[Entry, str] | None:
        """An entry and the tier its arrays came from in this restore: "ssd" for one
        read from its file by an earlier attempt of the same restore (then promoted)."""
        e = self.hot.get(entry_id)
        if e is not None:
            self._persist(e)
            return e, "ssd" if entry_id in self._ssd_loaded else "hot"
        if self.ssd is None or self.ssd.meta(entry_id) is None:
            return None
        meta = self.ssd.meta(entry_id)
        expected = self._expected_by_flags[meta.window, meta.snapshot]
        if meta.logprobs and self.logprobs_spec is not None:
            expected = {**expected, LOGPROBS: self.logprobs_spec}
        e = self.ssd.load(entry_id, expected=expected)
        if e is None:
            return None
        self._ssd_read += meta.nbytes
        self._ssd_loaded.add(entry_id)
        e.snapshot_nbytes = self._snapshot_nbytes(e.arrays)
        self.hot.put(e)  # promote
        return e, "ssd"

    def _snapshot_nbytes(self, arrays) -> int:
        names = tuple(f"{lf.name}." for lf in self.state)
        return sum(a.nbytes for k, a in arrays.items() if names and k.startswith(names))

    def restore_repeat(self, prompt: Sequence[int]) -> Restored | None:
        """The resident cache cut back to the whole ``prompt``, with the logprobs of its
        first token, when ``prompt`` is the prompt the resident's request answered (a
        regenerate, or the same question again): the first token then needs no forward,
        and the logprobs are the very ones a cold run samples it from. None (the resident
        stays) when the prompt differs, no logprobs were kept, or a leaf cannot be cut
        there in place (a state layer, a window that rotated).

        A prompt that is all of the resident's tokens (a continue of the reply it ended
        with) takes it whole, with the logprobs kept after its last token."""
        r, n = self.resident, len(prompt)
        if r is not None and r.end_logprobs is not None and r.tokens == tuple(prompt):
            self.take_resident()
            self.resident_hits += 1
            out = Restored(n, caches=r.caches, first_logprobs=r.end_logprobs)
            out.cached_kind["resident"] = out.cached_by["hot"] = n
            self.log(f"hit {n} tokens: resident, whole (a continue), first token from its end")
            return out
        if r is None or r.first_logprobs is None or r.prompt_tokens != n:
            return None
        if r.tokens[:n] != tuple(prompt):
            return None
        live = L.leaf_map(r.caches)
        if not all(lf.can_cut(live[lf.name], len(r.tokens), n) for lf in self.leaves):
            return None
        self.take_resident()
        for lf in self.leaves:
            lf.cut(live[lf.name], len(r.tokens), n)
        self.resident_hits += 1
        out = Restored(n, caches=r.caches, first_logprobs=r.first_logprobs)
        out.cached_kind["resident"] = n
        out.cached_by["hot"] = n
        self.log(f"hit {n} tokens: resident, first token from its kept logprobs")
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
        ``max_position`` tokens when given.

        ``ids``: the prompt's chain ids (:meth:`ids`); ``points``: its schedule; ``fresh``:
        makes a new cache list (``model.make_cache``). Takes the resident cache: the
        returned ``caches`` is it (cut back in place) when it served, else a fresh list.
        Entries that fail validation are evicted and counted.
        """
        resident = self.take_resident()
        self._ssd_read = 0
        self._ssd_loaded = set()
        limit = len(prompt) - 1
        # misses: the prompt's full blocks that a tier does not hold at lookup time
        hot_misses = self.hot_misses
        for i in ids[: max(limit, 0) // self.block_size]:
            if i not in self.hot:
                self.hot_misses += 1
                if self.ssd is not None and self.ssd.meta(i) is None:
                    self.ssd.misses += 1
        choice, use_ssd = None, True
        for _ in range(4):
            plan = self.plan(prompt, ids, points, resident, max_position, use_ssd)
            if plan is not None and choice is None:
                plan, choice = self._choose(plan, prompt, ids, points, resident, max_position)
                use_ssd = choice is None or choice.taken == "ssd"
            if plan is None:
                break
            loaded: list[tuple[int, Entry, str]] = []
            bad = None
            if self.ssd is not None:  # start the disk reads of every entry needed at once
                wanted = [ids[i] for i in plan.blocks if ids[i] not in self.hot]
                wanted += [i for i in plan.entry_ids() if i not in self.hot]
                self.ssd.read_ahead(wanted)
            for i in plan.blocks:
                got = self._fetch(ids[i])
                if got is None:
                    bad = ids[i]
                    break
                loaded.append((i, *got))
            tail = None
            if bad is None and plan.tail is not None:
                tail = self._fetch(plan.tail.id)
                if tail is None:
                    bad = plan.tail.id
            kept = kept_from = None
            if bad is None and plan.kept is not None:
                got = tail if plan.kept is plan.tail else self._fetch(plan.kept.id)
                kept = got[0].arrays.get(LOGPROBS) if got is not None else None
                kept_from = got[1] if got is not None and got is not tail else None
                if kept is None:
                    bad = plan.kept.id
            if bad is not None:
                self.restore_errors += 1
                self.log(f"entry {bad[:12]} could not be loaded: evicted")
                self.hot.remove(bad)
                self.writes.forget(bad)
                if self.ssd is not None:
                    self.ssd.remove(bad)
                continue
            if self.ssd is not None:
                self.ssd.drop_reads()
            out = self._fill(plan, loaded, tail, resident, fresh, kept_from)
            out.choice, out.ssd_bytes = choice, self._ssd_read
            if kept is not None:
                out.first_logprobs = kept
                where = f"{kept_from} tail" if kept_from else "tail"
                self.log(f"first token of {plan.position} from the {where}'s kept logprobs")
            return out
        if self.ssd is not None:
            self.ssd.drop_reads()
        self.tail_misses += 1
        if self.hot_misses == hot_misses:
            # a cold lookup is a hot miss even when the prompt has no full block
            self.hot_misses += 1
        return Restored(caches=fresh(), choice=choice)

    def _choose(self, plan: Plan, prompt, ids, points, resident, max_position):
        """``plan``, or the furthest plan from RAM only when computing the tokens that only
        the SSD tier holds is estimated faster than reading them (:mod:`.rates`); with the
        :class:`~.rates.Choice` made, None when the plan reads nothing from SSD or a rate
        is still unknown."""
        if self.ssd is None or self.rates is None:
            return plan, None
        on_ssd = [ids[i] for i in plan.blocks if ids[i] not in self.hot]
        on_ssd += [i for i in plan.entry_ids() if i not in self.hot]
        nbytes = sum(m.nbytes for m in map(self.ssd.meta, on_ssd) if m is not None)
        if not nbytes:
            return plan, None
        ram = self.plan(prompt, ids, points, resident, max_position, use_ssd=False)
        tokens = plan.position - (ram.position if ram is not None else 0)
        choice = self.rates.choose(tokens, nbytes)
        if choice is None:
            return plan, None
        self.log(choice.describe())
        return (ram if choice.taken == "recompute" else plan), choice

    def _fill(
        self, plan: Plan, loaded, tail, resident: Resident | None, fresh, kept_from=None
    ) -> Restored:
        """Fill the cache as ``plan`` says from the ``loaded`` blocks and ``tail`` (entry,
        source); ``kept_from``: the source of a kept-logprobs tail loaded only for them
        (every leaf cut from the resident cache), which counts as a source too."""
        P, bs = plan.position, self.block_size
        caches = resident.caches if plan.cut else fresh()
        live = L.leaf_map(caches)
        t_entry = tail[0] if tail else None
        copied = 0
        for leaf in self.leaves:
            c = live[leaf.name]
            if leaf.name in plan.cut:
                leaf.cut(c, len(resident.tokens), P)
                continue
            if leaf.snapshots:
                src = t_entry if t_entry is not None else loaded[-1][1]
                parts = [self._leaf_arrays(src, leaf.name)]
            else:
                lo = leaf.first_needed(P) // bs
                parts = [self._leaf_arrays(e, leaf.name) for i, e, _ in loaded if i >= lo]
                if t_entry is not None:
                    parts.append(
                        {
                            k: a[..., : plan.tail_tokens, :]
                            for k, a in self._leaf_arrays(t_entry, leaf.name).items()
                        }
                    )
            leaf.restore(c, parts, P)
            copied += sum(a.nbytes for part in parts for a in part.values())
        mx.eval([c.state for c in caches])

        out = Restored(P, nbytes=copied, caches=caches)
        sources = [src for _, _, src in loaded] + ([tail[1]] if tail else [])
        self.hot_hits += (sources + ([kept_from] if kept_from else [])).count("hot")
        if plan.cut:
            # The resident cache is RAM: its tokens count for the hot tier unless a leaf
            # that could not be cut was filled from SSD entries. A tail read only for its
            # kept logprobs moves no K/V (its read shows in ``ssd_bytes`` and the log).
            self.resident_hits += 1
            out.cached_kind["resident"] = P
            out.cached_by["ssd" if "ssd" in sources else "hot"] = P
        else:
            j = P // bs
            # a block's tokens count for the tier of the nearest loaded entry at or after it
            by_block = {i: src for i, _, src in loaded}
            nearest = tail[1] if tail else None
            for i in range(j - 1, -1, -1):
                nearest = by_block.get(i, nearest)
                out.cached_by[nearest or "hot"] += bs
            out.cached_kind["block"] = j * bs
            if tail:
                out.cached_by[tail[1]] += plan.tail_tokens
        if t_entry is not None and not plan.cut:
            if t_entry.kind == KIND_BLOCK:  # the first tokens of a block (an edit)
                out.cached_kind["block"] += plan.tail_tokens
                self.tail_misses += 1
            else:
                kind = "tail" if t_entry.kind == KIND_TAIL else "checkpoint"
                out.cached_kind[kind] += plan.tail_tokens
                self.tail_hits += 1
                self.tail_tokens_saved += plan.tail_tokens
                self.checkpoint_hits += kind == "checkpoint"
        by = {**out.cached_by, **out.cached_kind}
        self.log(f"hit {P} tokens: " + ", ".join(f"{k} {v}" for k, v in by.items() if v))
        self._flush_evictions()
        return out

    def _leaf_arrays(self, e: Entry, leaf_name: str) -> dict:
        prefix = f"{leaf_name}."
        return {k[len(prefix) :]: a for k, a in e.arrays.items() if k.startswith(prefix)}

    # ------------------------------------------------------------------ store
    def capture(self, *args, **kwargs) -> list[Entry]:
        """Entries for a span of the live cache (:meth:`.capture.Capture.capture`)."""
        return self.capturer.capture(*args, **kwargs)

    def complete(self, caches, entries: list[Entry]) -> None:
        """Fill in what entries deferred (:meth:`.capture.Capture.complete`)."""
        self.capturer.complete(caches, entries)

    def commit(self, entries: list[Entry]) -> None:
        """Put evaluated entries into the hot tier; they reach the SSD tier at the next
        :meth:`persist` (the engine calls it once the request's first token is out)."""
        for e in entries:
            e.nbytes = sum(a.nbytes for a in e.arrays.values())
            e.snapshot_nbytes = self._snapshot_nbytes(e.arrays)
            self.hot.put(e, pin=self.pin_system and e.kind == KIND_BLOCK and e.role == "system")
            if self.ssd is not None and self.writes.offer(e):
                self._unsaved.append(e)
            if e.kind != KIND_BLOCK and e.id in self.hot:
                self.tail_stashes += 1
        self._flush_evictions()

    def persist(self, max_due: int | None = None) -> int:
        """Hand the entries admitted since the last call and the deferred ones now due
        (at most ``max_due`` bytes: :meth:`.admission.WritePolicy.due`) to the SSD tier,
        in commit order; returns the bytes accepted."""
        if self.ssd is not None:
            self._unsaved += self.writes.due(max_due)
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

    def close(self) -> None:
        """Write what was admitted and what is still deferred (:mod:`.admission`), save
        the rates, close the SSD tier (its writer writes what is queued). Never raises: a
        failure is logged, and the tier still closes (its lock given back)."""
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
                self.ssd.close()

    def write_due_in(self) -> float | None:
        """Seconds until a deferred entry is due (0.0: now), None when none waits or the
        SSD writer is busy (its emptied queue wakes the engine): how long an idle engine
        may sleep (docs/DESIGN.md §8.6)."""
        if self.ssd is None or self.ssd.queue_depth:
            return None
        return self.writes.due_in()

    def write_due(self) -> int:
        """Hand the deferred entries now due to an idle SSD writer, a quarter of its
        pending bound at a time (one copy); returns the bytes accepted. The engine calls
        it while no request is held or waiting."""
        if self.ssd is None or self.ssd.queue_depth:
            return 0
        return self.persist(self.ssd.writer.max_pending_bytes // 4)

    # ------------------------------------------------------------------ the engine's calls
    # what the engine asks of the tiers, so that it never reaches into them (§2, §11)
    def begin_cold(self, fresh) -> ColdRequest:
        """A request with the cache off (:class:`~.request.ColdRequest`): it keeps nothing,
        and holds the SSD writer to its first token as a cached one does."""
        return ColdRequest(fresh, self.ssd)

    def fit_hot_budget(self, budget: Callable[[int], int]) -> tuple[int, int] | None:
        """Set the hot tier's budget to ``budget(held)`` bytes (``held``: the bytes it holds
        now), evicting down to it: ``(budget, entries evicted)``, or None if unchanged."""
        max_bytes = budget(self.hot.nbytes)
        if max_bytes == self.hot.max_bytes:
            return None
        return max_bytes, self.hot.set_budget(max_bytes)

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
