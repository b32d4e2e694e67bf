"""The restore path of the prefix cache (docs/DESIGN.md §9): a prompt's plan
(:mod:`.planner`) carried out over the resident cache, the hot tier and the SSD tier.

A restore lands on the furthest allowed, restorable position ``P`` of the plan (the rules:
:mod:`.prefix`), or on the whole prompt with its first token's logprobs kept from before
(:meth:`Restorer.repeat`). Entries are loaded (hot first, else SSD, promoted to hot; SSD
loads are verified there), and only then is the cache filled, with one concatenate per
layer. A bad entry is evicted from both tiers and the lookup repeats: a shorter prefix or
a cold start, never a wrong restore. When a rate is known (:mod:`.rates`), a plan that
reads from SSD gives way to the furthest one from RAM if computing the tokens only the SSD
tier holds is estimated faster than reading them.

The :class:`Restorer` is a collaborator of :class:`~.prefix.PrefixCache`, given what it
reads and moves explicitly: the tiers, the write policy, the planner, the counters, and
callbacks for a reused entry, the log and the end of a fill. Everything here runs on the
engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from . import layers as L
from .blocks import KIND_BLOCK, KIND_TAIL, LOGPROBS, Entry
from .fill import StreamedFill
from .layers import Spec
from .plans import Plan, Resident, Restored

if TYPE_CHECKING:
    from .admission import WritePolicy
    from .hot import HotTier
    from .rates import Rates
    from .ssd.tier import SSDTier
    from .stats import HitCounters


def snapshot_nbytes(arrays: dict[str, Any], state: Sequence[L.Leaf]) -> int:
    """Bytes of the state snapshots among an entry's ``arrays`` (those of the ``state``
    leaves)."""
    names = tuple(f"{lf.name}." for lf in state)
    return sum(a.nbytes for k, a in arrays.items() if names and k.startswith(names))


class Restorer:
    """Restores of one prefix cache (see the module doc). ``plan(prompt, ids, points,
    resident, max_position, use_ssd)``: the planner's plan (:meth:`.planner.Planner.plan`);
    ``reused(entry)``: a hot entry read by a restore (admission, repair); ``on_filled()``:
    a fill is done (the hot tier's evictions are logged); ``log(text)``: the event log.
    ``counts`` is moved as hits, misses and errors happen; ``ssd_read`` is the bytes of SSD
    files the current restore read."""

    def __init__(
        self,
        *,
        leaves: Sequence[L.Leaf],
        spec: Spec,
        block_size: int,
        hot: HotTier,
        ssd: SSDTier | None,
        writes: WritePolicy,
        rates: Rates | None,
        counts: HitCounters,
        plan: Callable[..., Plan | None],
        reused: Callable[[Entry], None],
        on_filled: Callable[[], None],
        log: Callable[[str], None],
    ) -> None:
        self.leaves = tuple(leaves)
        self.block_size = block_size
        self.hot, self.ssd, self.writes, self.rates = hot, ssd, writes, rates
        self.counts = counts
        self.plan, self.reused, self.on_filled, self.log = plan, reused, on_filled, log
        # ((vocab,), dtype) of the first-token logprobs a prompt tail may keep (None: none)
        self.logprobs_spec = spec.get(LOGPROBS)
        kv = [lf for lf in leaves if lf.kind == L.KIND_KV]
        window = [lf for lf in leaves if lf.kind == L.KIND_WINDOW]
        self.state = [lf for lf in leaves if lf.snapshots]
        # what an SSD file must hold, by its (window, snapshot) flags
        self._expected_by_flags = {
            (w, s): {
                k: v
                for lf in kv + (window if w else []) + (self.state if s else [])
                for k, v in spec.items()
                if k.startswith(lf.name + ".")
            }
            for w in (False, True)
            for s in (False, True)
        }
        self.ssd_read = 0  # bytes of SSD files the current restore read
        # ids the current restore read from SSD files (promoted to hot as they came: a
        # retry after a bad entry finds them there, and they still count as SSD tokens)
        self.ssd_loaded: set[str] = set()

    def repeat(self, prompt: Sequence[int], r: Resident | None) -> Restored | None:
        """The resident cache cut back to the whole ``prompt``, with the logprobs of its
        first token, when ``prompt`` is the prompt the resident's request answered (a
        regenerate, or the same question again): the first token then needs no forward,
        and the logprobs are the very ones a cold run samples it from. None (the resident
        stays) when the prompt differs, no logprobs were kept, or a leaf cannot be cut
        there in place (a state layer, a window that rotated). ``r``: the resident cache
        (:attr:`.prefix.PrefixCache.resident`), which the caller takes when this returns a
        restore (its caches are the returned ones).

        A prompt that is all of the resident's tokens (a continue of the reply it ended
        with) takes it whole, with the logprobs kept after its last token."""
        n = len(prompt)
        if r is not None and r.end_logprobs is not None and r.tokens == tuple(prompt):
            self.counts.resident_hits += 1
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
        for lf in self.leaves:
            lf.cut(live[lf.name], len(r.tokens), n)
        self.counts.resident_hits += 1
        out = Restored(n, caches=r.caches, first_logprobs=r.first_logprobs)
        out.cached_kind["resident"] = n
        out.cached_by["hot"] = n
        self.log(f"hit {n} tokens: resident, first token from its kept logprobs")
        return out

    def restore(
        self,
        prompt: Sequence[int],
        ids: Sequence[str],
        points: Sequence[int],
        resident: Resident | None,
        fresh,
        max_position: int | None = None,
    ) -> Restored:
        """Restore the furthest allowed prefix of ``prompt`` (the rules: :mod:`.prefix`), at most
        ``max_position`` tokens when given.

        ``ids``: the prompt's chain ids (:meth:`.prefix.PrefixCache.ids`); ``points``: its
        schedule; ``resident``: the resident cache, taken by the caller (the returned
        ``caches`` is it, cut back in place, when it served, else a fresh list); ``fresh``:
        makes a new cache list (``model.make_cache``).
        Entries that fail validation are evicted and counted.
        """
        self.ssd_read = 0
        self.ssd_loaded = set()
        limit = len(prompt) - 1
        # misses: the prompt's full blocks that a tier does not hold at lookup time
        hot_misses = self.counts.hot_misses
        for i in ids[: max(limit, 0) // self.block_size]:
            if i not in self.hot:
                self.counts.hot_misses += 1
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
            bad = stream = None
            if self.ssd is not None:  # start the disk reads of every entry needed at once
                wanted = [ids[i] for i in plan.blocks if ids[i] not in self.hot]
                wanted += [i for i in plan.entry_ids() if i not in self.hot]
                self.ssd.reader.read_ahead(wanted)
                # K/V copied into the cache as it comes, beside the reads after it
                stream = self._streamed_fill(plan, len(prompt)) if wanted else None
            for i in plan.blocks:
                got = self._fetch(ids[i])
                if got is None:
                    bad = ids[i]
                    break
                loaded.append((i, *got))
                if stream is not None:
                    stream.add(got[0], self.block_size)
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
                self.counts.restore_errors += 1
                self.log(f"entry {bad[:12]} could not be loaded: evicted")
                self.hot.remove(bad)
                self.writes.forget(bad)
                if self.ssd is not None:
                    self.ssd.remove(bad)
                continue
            if self.ssd is not None:
                self.ssd.reader.drop_reads()
            out = self._fill(plan, loaded, tail, resident, fresh, kept_from, stream)
            out.choice, out.ssd_bytes = choice, self.ssd_read
            if kept is not None:
                out.first_logprobs = kept
                where = f"{kept_from} tail" if kept_from else "tail"
                self.log(f"first token of {plan.position} from the {where}'s kept logprobs")
            return out
        if self.ssd is not None:
            self.ssd.reader.drop_reads()
        self.counts.tail_misses += 1
        if self.counts.hot_misses == hot_misses:
            # a cold lookup is a hot miss even when the prompt has no full block
            self.counts.hot_misses += 1
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

    def _streamed_fill(self, plan: Plan, prompt_tokens: int) -> StreamedFill | None:
        """A :class:`~.fill.StreamedFill` of the plan's K/V leaves not cut from the
        resident cache, with room for the prompt's ``prompt_tokens`` and a first decoded
        token, or None when there is none or the plan's blocks are not the chain from its
        first block (then :meth:`_fill` concatenates, as for a restore from RAM)."""
        leaves = [lf for lf in self.leaves if isinstance(lf, L.KVLeaf) and lf.name not in plan.cut]
        covered = len(plan.blocks) * self.block_size
        covered += plan.tail_tokens if plan.tail is not None else 0
        if not leaves or plan.blocks != tuple(range(len(plan.blocks))) or covered != plan.position:
            return None
        return StreamedFill(leaves, plan.position, length=prompt_tokens + 1)

    def _fetch(self, entry_id: str) -> tuple[Entry, str] | None:
        """An entry and the tier its arrays came from in this restore: "ssd" for one
        read from its file by an earlier attempt of the same restore (then promoted)."""
        e = self.hot.get(entry_id)
        if e is not None:
            self.reused(e)
            return e, "ssd" if entry_id in self.ssd_loaded else "hot"
        if self.ssd is None or self.ssd.meta(entry_id) is None:
            return None
        meta = self.ssd.meta(entry_id)
        expected = self._expected_by_flags[meta.window, meta.snapshot]
        if meta.logprobs and self.logprobs_spec is not None:
            expected = {**expected, LOGPROBS: self.logprobs_spec}
        e = self.ssd.load(entry_id, expected=expected)
        if e is None:
            return None
        self.ssd_read += meta.nbytes
        self.ssd_loaded.add(entry_id)
        e.snapshot_nbytes = snapshot_nbytes(e.arrays, self.state)
        self.hot.put(e)  # promote
        return e, "ssd"

    def _fill(
        self,
        plan: Plan,
        loaded,
        tail,
        resident: Resident | None,
        fresh,
        kept_from=None,
        stream: StreamedFill | None = None,
    ) -> Restored:
        """Fill the cache as ``plan`` says from the ``loaded`` blocks and ``tail`` (entry,
        source); ``kept_from``: the source of a kept-logprobs tail loaded only for them
        (every leaf cut from the resident cache), which counts as a source too;
        ``stream``: the K/V leaves' buffers, filled with the blocks as they were loaded."""
        P, bs = plan.position, self.block_size
        caches = resident.caches if plan.cut else fresh()
        live = L.leaf_map(caches)
        t_entry = tail[0] if tail else None
        copied = 0
        if stream is not None:
            if t_entry is not None:
                stream.add(t_entry, plan.tail_tokens)
            copied += stream.nbytes
        for leaf in self.leaves:
            c = live[leaf.name]
            if leaf.name in plan.cut:
                leaf.cut(c, len(resident.tokens), P)
                continue
            if stream is not None and leaf.name in stream.buffers:
                stream.adopt(leaf, c)
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
        self.counts.hot_hits += (sources + ([kept_from] if kept_from else [])).count("hot")
        if plan.cut:
            # The resident cache is RAM: its tokens count for the hot tier unless a leaf
            # that could not be cut was filled from SSD entries. A tail read only for its
            # kept logprobs moves no K/V (its read shows in ``ssd_bytes`` and the log).
            self.counts.resident_hits += 1
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
                self.counts.tail_misses += 1
            else:
                kind = "tail" if t_entry.kind == KIND_TAIL else "checkpoint"
                out.cached_kind[kind] += plan.tail_tokens
                self.counts.tail_hits += 1
                self.counts.tail_tokens_saved += plan.tail_tokens
                self.counts.checkpoint_hits += kind == "checkpoint"
        by = {**out.cached_by, **out.cached_kind}
        self.log(f"hit {P} tokens: " + ", ".join(f"{k} {v}" for k, v in by.items() if v))
        self.on_filled()
        return out

    def _leaf_arrays(self, e: Entry, leaf_name: str) -> dict:
        prefix = f"{leaf_name}."
        return {k[len(prefix) :]: a for k, a in e.arrays.items() if k.startswith(prefix)}
