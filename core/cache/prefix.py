"""The prefix cache: lookup, all-or-nothing restore, and store, over the hot and SSD tiers.

Lookup (DESIGN.md §5) finds the furthest position ``P <= N - 1`` of a prompt of ``N``
tokens at which every layer can be rebuilt exactly:

- KV leaves need the K/V slices of every block before ``P`` (plus a tail's slice);
- window leaves need the slices covering ``[P - max_size, P)``;
- state leaves need a snapshot taken at ``P`` exactly: at a block end, or in a tail /
  checkpoint entry that ends at ``P``.

Candidates are block ends and the entries (tails, checkpoints, other blocks) that hang off
the prompt's chain of block ids; for models without state leaves such an entry may also be
used in part, up to the common prefix of its tokens and the prompt's -- the way a trie of
trimmable caches serves an edit in the middle of a block. The winner's entries are loaded (hot first, else SSD, promoted to hot), every
array is checked against the model's shapes, and only then is a fresh cache filled, with
one concatenate per layer. A bad entry is evicted from both tiers and the lookup repeats:
a shorter prefix or a cold start, never a wrong restore.

Everything here runs on the engine thread.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..api import CACHE_KINDS, CACHE_SOURCES, SnapshotStats, TailStats, TierStats
from . import layers as L
from .blocks import (
    KIND_BLOCK,
    KIND_SEQ,
    KIND_TAIL,
    ChainHasher,
    Entry,
    role_at,
    root_id,
    tail_id,
)
from .hot import HotTier
from .ssd import CorruptEntry, SSDTier, check_arrays

Spec = dict[str, tuple[tuple[int, ...], Any]]


@dataclass
class Restored:
    """What a restore put into the cache: ``position`` tokens, split by tier (``cached_by``)
    and by entry kind (``cached_kind``)."""

    position: int = 0
    cached_by: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHE_SOURCES, 0))
    cached_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHE_KINDS, 0))
    nbytes: int = 0  # bytes written into the fresh cache


@dataclass(frozen=True)
class _Cand:
    position: int
    blocks: int  # number of chain blocks in front of it
    tail: Any = None  # Entry or FileMeta of a tail, or None for a block end
    tail_tokens: int = 0


def probe_specs(leaves: Sequence[L.Leaf], caches: list[Any]) -> Spec:
    """Shapes and dtypes of every cached array, read off a cache that has seen >= 1 token.

    The token axis of slices is recorded as -1. Used to validate entries before restore.
    """
    live = L.leaf_map(caches)
    spec: Spec = {}
    for leaf in leaves:
        c = live[leaf.name]
        if leaf.kind == L.KIND_STATE:
            parts = L.snapshot(leaf, c)
            for n, a in parts.items():
                spec[f"{leaf.name}.{n}"] = (tuple(a.shape), a.dtype)
        else:
            parts = L.capture_slice(leaf, c, c.offset - 1, c.offset)
            for n, a in parts.items():
                shape = list(a.shape)
                shape[2] = -1
                spec[f"{leaf.name}.{n}"] = (tuple(shape), a.dtype)
    return spec


class PrefixCache:
    """Blocks, tails and checkpoints of one model over a hot and an SSD tier."""

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
        max_tails: int = 8,
        max_checkpoints: int = 32,
        writer_queue: int = 64,
        pin_system: bool = True,
    ) -> None:
        self.fingerprint = fingerprint
        self.root = root_id(fingerprint)
        self._chain = ChainHasher(self.root, block_size)
        self.leaves = tuple(leaves)
        self.spec = spec
        self.block_size = block_size
        self.pin_system = pin_system
        self.kv = [lf for lf in leaves if lf.kind == L.KIND_KV]
        self.window = [lf for lf in leaves if lf.kind == L.KIND_WINDOW]
        self.state = [lf for lf in leaves if lf.kind == L.KIND_STATE]
        self.max_window = max((lf.max_size for lf in self.window), default=0)
        self.events: deque[tuple[int, str]] = deque(maxlen=200)
        self._seq = itertools.count(1)
        self.hot = HotTier(hot_bytes, max_tails, max_checkpoints, on_evict=self._evicted)
        self.ssd = (
            SSDTier(ssd_dir, fingerprint, ssd_bytes, writer_queue, on_event=self.log)
            if ssd_dir is not None
            else None
        )
        # counters
        self.hot_hits = self.hot_misses = 0
        self.tail_stashes = self.tail_hits = self.tail_misses = self.tail_tokens_saved = 0
        self.checkpoint_hits = 0
        self.restore_errors = 0
        self._evicted_batch = 0

    # ------------------------------------------------------------------ events
    def log(self, text: str) -> None:
        self.events.append((next(self._seq), text))

    def _evicted(self, e: Entry, why: str) -> None:
        self._evicted_batch += 1

    def _flush_evictions(self) -> None:
        if self._evicted_batch:
            self.log(f"hot: evicted {self._evicted_batch} entries")
            self._evicted_batch = 0

    # ------------------------------------------------------------------ lookup
    def _flags(self, entry_id: str):
        """``(source, window, snapshot)`` of an entry in hot or SSD, or None."""
        e = self.hot.peek(entry_id)
        if e is not None:
            return ("hot", e.window, e.snapshot)
        if self.ssd is not None:
            m = self.ssd.meta(entry_id)
            if m is not None:
                return ("ssd", m.window, m.snapshot)
        return None

    def _children(self, parent: str) -> list:
        """Entries (hot ``Entry`` or SSD ``FileMeta``) that follow ``parent``."""
        found = {i: self.hot.peek(i) for i in self.hot.children.get(parent, ())}
        if self.ssd is not None:
            for m in self.ssd.children_of(parent):
                found.setdefault(m.id, m)
        return [t for t in found.values() if t is not None]

    def _restorable(self, flags: list, blocks: int, position: int, tail=None) -> bool:
        if self.kv and not all(flags[:blocks]):
            return False
        if self.window:
            lo = max(0, position - self.max_window)
            for i in range(lo // self.block_size, blocks):
                if not (flags[i] and flags[i][1]):
                    return False
            if tail is not None and not tail.window:
                return False
        if self.state:
            if tail is not None:
                return tail.snapshot
            return blocks > 0 and bool(flags[blocks - 1]) and flags[blocks - 1][2]
        return True

    def plan(self, prompt: Sequence[int]) -> _Cand | None:
        """The furthest restorable position for ``prompt`` (at most ``len(prompt) - 1``)."""
        limit = len(prompt) - 1
        if limit <= 0:
            return None
        bs = self.block_size
        ids = self._chain.ids(prompt, limit // bs)
        flags = [self._flags(i) for i in ids]
        for j in range(len(ids), -1, -1):
            parent = ids[j - 1] if j else self.root
            best, best_rank = None, None
            for t in self._children(parent):
                if t.start != j * bs:
                    continue
                seg = prompt[j * bs : limit]
                n = 0
                for a, b in zip(t.tokens, seg, strict=False):
                    if a != b:
                        break
                    n += 1
                if n == 0 or (n < len(t.tokens) and self.state):
                    continue
                cand = _Cand(j * bs + n, j, t, n)
                # ties go to prompt tails (kind "tail") over checkpoints, for stable stats
                rank = (cand.position, t.kind == KIND_TAIL)
                if (best is None or rank > best_rank) and self._restorable(
                    flags, j, cand.position, t
                ):
                    best, best_rank = cand, rank
            if best is not None:
                return best
            if j > 0 and self._restorable(flags, j, j * bs):
                return _Cand(j * bs, j)
        return None

    # ------------------------------------------------------------------ restore
    def _expected(self, e, ntokens_only: bool = False) -> Spec:
        exp = {}
        for leaf in (
            self.kv + (self.window if e.window else []) + (self.state if e.snapshot else [])
        ):
            exp.update({k: v for k, v in self.spec.items() if k.startswith(leaf.name + ".")})
        return exp

    def _fetch(self, entry_id: str) -> tuple[Entry, str] | None:
        e = self.hot.get(entry_id)
        if e is not None:
            self._persist(e)
            return e, "hot"
        if self.ssd is None:
            return None
        meta = self.ssd.meta(entry_id)
        if meta is None:
            return None
        e = self.ssd.load(entry_id, expected=self._expected(meta))
        if e is None:
            return None
        e.snapshot_nbytes = self._snapshot_nbytes(e.arrays)
        self.hot.put(e)  # promote
        return e, "ssd"

    def _snapshot_nbytes(self, arrays) -> int:
        names = tuple(f"{lf.name}." for lf in self.state)
        return sum(a.nbytes for k, a in arrays.items() if names and k.startswith(names))

    def _needed_blocks(self, cand: _Cand) -> list[int]:
        j, bs = cand.blocks, self.block_size
        if self.kv:
            return list(range(j))
        need = set()
        if self.window:
            lo = max(0, cand.position - self.max_window) // bs
            need.update(range(lo, j))
        if self.state and cand.tail is None and j:
            need.add(j - 1)
        return sorted(need)

    def restore(self, prompt: Sequence[int], caches: list[Any]) -> Restored:
        """Fill the fresh ``caches`` with the longest restorable prefix of ``prompt``.

        Returns the number of tokens restored (0: nothing usable, caches untouched) and
        their split by source. Entries that fail validation are evicted and counted.
        """
        limit = len(prompt) - 1
        ids = self._chain.ids(prompt, max(limit, 0) // self.block_size)
        # misses: the prompt's full blocks that a tier does not hold at lookup time
        flags = [self._flags(i) for i in ids]
        self.hot_misses += sum(1 for f in flags if f is None or f[0] != "hot")
        if self.ssd is not None:
            self.ssd.misses += sum(1 for f in flags if f is None)
        for _ in range(4):
            cand = self.plan(prompt)
            if cand is None:
                self.tail_misses += 1
                return Restored()
            loaded, bad = [], None
            for i in self._needed_blocks(cand):
                got = self._fetch(ids[i])
                if got is None:
                    bad = ids[i]
                    break
                loaded.append((i, *got))
            tail = None
            if bad is None and cand.tail is not None:
                tail = self._fetch(cand.tail.id)
                if tail is None:
                    bad = cand.tail.id
            if bad is None:
                try:
                    for _, e, _src in loaded + ([(None, *tail)] if tail else []):
                        check_arrays(e.arrays, self._expected(e), len(e.tokens))
                except CorruptEntry as exc:
                    bad = e.id
                    self.log(f"entry {bad[:12]} failed validation: {exc}")
            if bad is not None:
                self.restore_errors += 1
                self.hot.remove(bad)
                if self.ssd is not None:
                    self.ssd.remove(bad)
                continue
            return self._fill(caches, cand, loaded, tail)
        return Restored()

    def _fill(self, caches, cand: _Cand, loaded, tail) -> Restored:
        live = L.leaf_map(caches)
        P = cand.position
        t_entry = tail[0] if tail else None
        for leaf in self.leaves:
            c = live[leaf.name]
            if leaf.kind == L.KIND_STATE:
                src = t_entry if t_entry is not None else loaded[-1][1]
                L.restore_state(leaf, c, self._leaf_arrays(src, leaf.name))
                continue
            blocks = loaded
            if leaf.kind == L.KIND_WINDOW:
                lo = max(0, P - leaf.max_size) // self.block_size
                blocks = [b for b in loaded if b[0] >= lo]
            parts = [self._leaf_arrays(b[1], leaf.name) for b in blocks]
            if t_entry is not None:
                parts.append(
                    {
                        k: a[..., : cand.tail_tokens, :]
                        for k, a in self._leaf_arrays(t_entry, leaf.name).items()
                    }
                )
            L.restore_kv(leaf, c, parts, P)
        mx.eval([c.state for c in caches])

        out = Restored(P, nbytes=sum(c.nbytes for c in caches))
        bs = self.block_size
        # tokens of a block count for the tier of the nearest loaded entry at or after it
        sources = {i: src for i, _, src in loaded}
        after = tail[1] if tail and t_entry.kind != KIND_BLOCK else None
        for i in range(cand.blocks - 1, -1, -1):
            after = sources.get(i, after)
            out.cached_by[after or "hot"] += bs
        out.cached_kind["block"] += cand.blocks * bs
        self.hot_hits += sum(1 for _, _, src in loaded if src == "hot")
        if t_entry is not None:
            out.cached_by[tail[1]] += cand.tail_tokens
            self.hot_hits += tail[1] == "hot"
        if t_entry is not None and t_entry.kind == KIND_BLOCK:
            # the first tokens of a stored block that diverges later (an edit)
            out.cached_kind["block"] += cand.tail_tokens
            self.tail_misses += 1
        elif t_entry is not None:
            kind = "tail" if t_entry.kind == KIND_TAIL else "checkpoint"
            out.cached_kind[kind] += cand.tail_tokens
            self.tail_hits += 1
            self.tail_tokens_saved += cand.tail_tokens
            if kind == "checkpoint":
                self.checkpoint_hits += 1
        else:
            self.tail_misses += 1
        by = {**out.cached_by, **out.cached_kind}
        self.log(f"hit {P} tokens: " + ", ".join(f"{k} {v}" for k, v in by.items() if v))
        self._flush_evictions()
        return out

    def _leaf_arrays(self, e: Entry, leaf_name: str) -> dict:
        prefix = f"{leaf_name}."
        return {k[len(prefix) :]: a for k, a in e.arrays.items() if k.startswith(prefix)}

    # ------------------------------------------------------------------ store
    def _capture(self, caches, start: int, end: int, snapshot: bool) -> tuple[dict, bool, bool]:
        live = L.leaf_map(caches)
        arrays, window_ok = {}, True
        for leaf in self.kv + self.window:
            got = L.capture_slice(leaf, live[leaf.name], start, end)
            if got is None:
                window_ok = False
                continue
            arrays.update({f"{leaf.name}.{k}": a for k, a in got.items()})
        if snapshot:
            for leaf in self.state:
                arrays.update(
                    {f"{leaf.name}.{k}": a for k, a in L.snapshot(leaf, live[leaf.name]).items()}
                )
        return arrays, window_ok, snapshot and bool(self.state)

    def _persist(self, e: Entry) -> None:
        """Write-through repair: queue a hot entry the SSD tier does not hold (after an
        SSD clear, a dropped write or a full disk), so a restart still finds it."""
        if self.ssd is not None:
            self.ssd.put(e)

    def _put(self, e: Entry, pin: bool = False) -> None:
        mx.eval(list(e.arrays.values()))
        e.nbytes = sum(a.nbytes for a in e.arrays.values())
        e.snapshot_nbytes = self._snapshot_nbytes(e.arrays)
        self.hot.put(e, pin=pin)
        if self.ssd is not None:
            self.ssd.put(e)
        self._flush_evictions()

    def store_block(
        self, caches, tokens: Sequence[int], j: int, boundaries=(), at_end: bool = True
    ) -> bool:
        """Store block ``j`` of ``tokens`` from the live cache unless already held.

        ``at_end``: the cache's offset is exactly this block's end, so state leaves can be
        snapshotted. Returns True when something was stored.
        """
        bs = self.block_size
        bid = self._chain.ids(tokens, j + 1)[j]
        have = self._flags(bid)
        want_snapshot = at_end and bool(self.state)
        if have is not None and (have[1] or not self.window) and (have[2] or not want_snapshot):
            held = self.hot.peek(bid)
            if held is not None:
                self._persist(held)
            return False
        arrays, window_ok, snap = self._capture(caches, j * bs, (j + 1) * bs, want_snapshot)
        parent = self._chain.ids(tokens, j)[-1] if j else self.root
        role = role_at(boundaries, (j + 1) * bs)
        e = Entry(
            id=bid,
            parent=parent,
            kind=KIND_BLOCK,
            start=j * bs,
            tokens=tuple(tokens[j * bs : (j + 1) * bs]),
            role=role,
            window=window_ok or not self.window,
            snapshot=snap,
            arrays=arrays,
        )
        pin = self.pin_system and role == "system"
        self._put(e, pin=pin)
        return True

    def store_tail(
        self, caches, tokens: Sequence[int], position: int, kind: str, role: str
    ) -> bool:
        """Store the tail ``tokens[floor(position / bs) * bs : position]`` as ``kind``.

        The cache's offset must equal ``position``. Skipped at block ends (the block
        serves) and when the tail store is disabled.
        """
        bs = self.block_size
        j = position // bs
        if position % bs == 0 or position <= 0:
            return False
        parent = self._chain.ids(tokens, j)[-1] if j else self.root
        seg = tuple(tokens[j * bs : position])
        tid = tail_id(parent, seg)
        held = self.hot.get(tid)
        if held is not None:
            self._persist(held)
            return False
        arrays, window_ok, snap = self._capture(caches, j * bs, position, True)
        e = Entry(
            id=tid,
            parent=parent,
            kind=kind,
            start=j * bs,
            tokens=seg,
            role=role,
            window=window_ok or not self.window,
            snapshot=snap,
            arrays=arrays,
        )
        self._put(e)
        if tid in self.hot:
            self.tail_stashes += 1
        return True

    def store_sequence(self, caches, sequence: Sequence[int], boundaries=()) -> None:
        """After decoding: store new full blocks of ``sequence`` and its end as a tail.

        ``sequence`` is prompt + every generated token; the cache's offset equals its
        length. Blocks in the middle get no state snapshot (decode does not stop there).
        """
        bs = self.block_size
        n = len(sequence)
        for j in range(n // bs):
            self.store_block(caches, sequence, j, boundaries, at_end=(j + 1) * bs == n)
        self.store_tail(caches, sequence, n, KIND_SEQ, "assistant")

    # ------------------------------------------------------------------ admin
    def clear(self, tier: str) -> str:
        """Clear ``hot``, ``ssd``, ``tails`` or ``all``; returns a one-line report."""
        if tier == "hot":
            n = self.hot.clear()
            msg = f"cleared hot tier ({n} entries)"
        elif tier == "tails":
            n = self.hot.clear(tails_only=True)
            if self.ssd is not None:
                for entry_id in self.ssd.tail_ids():
                    self.ssd.remove(entry_id)
            msg = f"cleared tails and checkpoints ({n} in RAM)"
        elif tier == "ssd":
            n = self.ssd.clear() if self.ssd is not None else 0
            msg = f"cleared SSD tier ({n} files)"
        elif tier == "all":
            a = self.hot.clear()
            b = self.ssd.clear() if self.ssd is not None else 0
            msg = f"cleared all tiers ({a} in RAM, {b} files)"
        else:
            raise ValueError(f"unknown tier {tier!r}: expected hot, ssd, tails or all")
        self.log(msg)
        return msg

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()

    # ------------------------------------------------------------------ stats
    def tier_stats(self) -> tuple[TierStats, TierStats, TailStats, SnapshotStats]:
        hot = self.hot
        hot_stats = TierStats(
            entries=len(hot),
            nbytes=hot.nbytes,
            max_bytes=hot.max_bytes,
            hits=self.hot_hits,
            misses=self.hot_misses,
            evictions=hot.evictions,
            errors=self.restore_errors,
        )
        s = self.ssd
        if s is None:
            ssd_stats = TierStats(enabled=False, reason="SSD tier off")
        else:
            ssd_stats = TierStats(
                entries=len(s),
                nbytes=s.nbytes,
                max_bytes=s.max_bytes,
                hits=s.hits,
                misses=s.misses,
                evictions=s.evictions,
                saves_queued=s.saves_queued,
                saves_persisted=s.saves_persisted,
                write_drops=s.write_drops,
                errors=s.errors,
                corrupt=s.corrupt,
                queue_depth=s.queue_depth,
                enabled=s.enabled,
                reason=s.reason,
            )
        tails = TailStats(
            entries=hot.n_tails,
            max_entries=hot.max_tails,
            nbytes=hot.tail_nbytes,
            stashes=self.tail_stashes,
            hits=self.tail_hits,
            misses=self.tail_misses,
            evictions=hot.tail_evictions,
            tokens_saved=self.tail_tokens_saved,
            checkpoints=hot.n_checkpoints,
            checkpoint_hits=self.checkpoint_hits,
            supported=True,
        )
        snaps = SnapshotStats(count=hot.snapshot_count, nbytes=hot.snapshot_nbytes)
        return hot_stats, ssd_stats, tails, snaps
