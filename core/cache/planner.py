"""The restore planner: which entries restore the longest allowed prefix of a prompt
(docs/DESIGN.md §9). It reads the tiers through a :class:`~.view.TierView` (the
:class:`~.prefix.PrefixCache`: its layout, where each entry is held, the entries after a
block) and only decides: it moves no array, so it can be tested with hand-filled tiers
and no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import layers as L
from .blocks import (
    KIND_BLOCK,
    KIND_TAIL,
    Entry,
    EntryMeta,
    common_prefix_len,
    tail_id,
)
from .plans import Held, Plan, Resident
from .view import TierView

# the entries after each chain block that match the prompt: block index -> (common tokens,
# entry)
After = dict[int, list[tuple[int, EntryMeta]]]


class Planner:
    """Plans restores over ``view`` (see the module doc)."""

    def __init__(self, view: TierView) -> None:
        self.view = view

    def plan(
        self,
        prompt: Sequence[int],
        ids: Sequence[str],
        points: Sequence[int],
        resident: Resident | None = None,
        max_position: int | None = None,
        use_ssd: bool = True,
    ) -> Plan | None:
        """The furthest allowed position at which every leaf can be rebuilt, or None.

        ``ids``: the prompt's chain ids; ``points``: its schedule (:func:`schedule_points`);
        ``max_position``: no plan beyond this many tokens (None: up to ``N - 1``, or ``N``
        through the prompt's tail that kept its first token's logprobs, on the folded
        schedule: :meth:`_plan_kept`); ``use_ssd``: False plans from the resident cache
        and the hot tier only.
        """
        if self.view.exact_prefix and (max_position is None or max_position >= len(prompt)):
            kept = self._plan_kept(prompt, ids, resident, use_ssd)
            if kept is not None:
                return kept
        limit = len(prompt) - 1
        if max_position is not None:
            limit = min(limit, max_position)
        if limit <= 0:
            return None
        bs = self.view.block_size
        prompt = tuple(prompt)
        if resident is not None and common_prefix_len(resident.tokens, prompt) >= limit:
            # the resident cache holds the whole prompt: no restore can go further than
            # cutting it back to N - 1, if every leaf can be cut there
            live = L.leaf_map(resident.caches)
            n_res = len(resident.tokens)
            if all(lf.can_cut(live[lf.name], n_res, limit) for lf in self.view.leaves):
                return Plan(limit, frozenset(lf.name for lf in self.view.leaves))
        held = [self.view.held(i, use_ssd) for i in ids[: limit // bs]]
        # entries after each chain block that match the prompt: (common tokens, entry)
        after: After = {}
        allowed = set(points)
        for j in range(len(held) + 1):
            parent = ids[j - 1] if j else self.view.root
            found = []
            for t in self.view.children(parent, use_ssd):
                if t.start != j * bs:
                    continue
                lo = j * bs
                n = common_prefix_len(tuple(t.tokens), prompt[lo : min(limit, lo + len(t.tokens))])
                if n:
                    found.append((n, t))
                    if n == len(t.tokens) and t.kind != KIND_BLOCK:
                        allowed.add(j * bs + n)  # an earlier sequence stopped here
            after[j] = found
        common, live = 0, None
        if resident is not None:
            common = common_prefix_len(resident.tokens, prompt)
            if common == len(resident.tokens):
                allowed.add(common)
            live = L.leaf_map(resident.caches)
        best = None
        for P in sorted((p for p in allowed if 0 < p <= limit), reverse=True):
            best = self._plan_at(P, prompt, held, after, resident, common, live)
            if best is not None:
                break
        if self.view.state:
            return best
        # Models without state layers can also stop at the exact common prefix (as a trie
        # of trimmable caches would). With the bitwise schedule, only when it saves more
        # than a block over the last schedule point: the tokens between would be computed
        # in a chunk the cold run does not have, so the schedule point is preferred at
        # equal speed. With the folded schedule (``exact_prefix``), whenever it is further.
        n_chain = next((j for j, h in enumerate(held) if h is None), len(held))
        extent = n_chain * bs + max((n for n, _ in after.get(n_chain, ())), default=0)
        floor = best.position if best is not None else 0
        margin = 0 if self.view.exact_prefix else bs
        for P in sorted({min(limit, extent), min(limit, common)}, reverse=True):
            if P - floor > margin:
                plan = self._plan_at(P, prompt, held, after, resident, common, live)
                if plan is not None:
                    return plan
        return best

    def _kept_tail(
        self, prompt: Sequence[int], ids: Sequence[str], use_ssd: bool
    ) -> EntryMeta | None:
        """The prompt's tail entry (hot ``Entry`` or SSD ``FileMeta``) that ends exactly at
        the prompt's end and kept its first token's logprobs, or None."""
        n, bs = len(prompt), self.view.block_size
        j, r = divmod(n, bs)
        if not r or self.view.logprobs_spec is None or len(ids) < j:
            return None
        parent = ids[j - 1] if j else self.view.root
        seg = tuple(prompt[j * bs : n])
        tid = tail_id(parent, seg)
        found = self.view.find(tid, use_ssd)
        if (
            found is None
            or not found.logprobs
            or found.kind != KIND_TAIL
            or found.start != j * bs
            or tuple(found.tokens) != seg
        ):
            return None
        return found

    def _plan_kept(
        self,
        prompt: Sequence[int],
        ids: Sequence[str],
        resident: Resident | None,
        use_ssd: bool,
    ) -> Plan | None:
        """A restore of the whole prompt (``N``) through its tail that kept the first
        token's logprobs (:meth:`_kept_tail`): every leaf rebuilt at ``N`` from the
        resident cache, the chain's blocks and that tail. None where any leaf cannot be."""
        kept = self._kept_tail(prompt, ids, use_ssd)
        if kept is None:
            return None
        n, bs = len(prompt), self.view.block_size
        prompt = tuple(prompt)
        held = [self.view.held(i, use_ssd) for i in ids[: n // bs]]
        common, live = 0, None
        if resident is not None:
            common = common_prefix_len(resident.tokens, prompt)
            live = L.leaf_map(resident.caches)
        after = {n // bs: [(len(kept.tokens), kept)]}
        plan = self._plan_at(n, prompt, held, after, resident, common, live)
        if plan is None:
            return None
        plan.kept = kept
        return plan

    def _plan_at(
        self,
        P: int,
        prompt: tuple[int, ...],
        held: list[Held | None],
        after: After,
        resident: Resident | None,
        common: int,
        live: dict[str, Any] | None,
    ) -> Plan | None:
        bs = self.view.block_size
        j, r = divmod(P, bs)
        cut: set[str] = set()
        if resident is not None and P <= common:
            n_res = len(resident.tokens)
            cut = {lf.name for lf in self.view.leaves if lf.can_cut(live[lf.name], n_res, P)}
        rest = [lf for lf in self.view.leaves if lf.name not in cut]
        if not rest:
            return Plan(P, frozenset(cut))
        slices = [lf for lf in rest if lf.slices]
        need_window = any(lf.kind == L.KIND_WINDOW for lf in rest)
        need_snapshot = any(lf.snapshots for lf in rest)
        need = set()
        if slices:
            need.update(range(min(lf.first_needed(P) for lf in slices) // bs, j))
        if need_snapshot and r == 0:
            need.add(j - 1)
        for i in need:
            h = held[i] if 0 <= i < len(held) else None
            if h is None or (need_window and not h.window):
                return None
        if need_snapshot and r == 0 and not held[j - 1].snapshot:
            return None
        tail = None
        if r:
            # one entry after block j covering [j * bs, P); ending exactly at P when it
            # must carry the state snapshot. Hot entries first (no disk read).
            # Ties are broken by a fixed order (hot, whole, prompt tail, id), never by
            # set iteration order, so one cache state always gives one plan.
            best: tuple[tuple[bool, bool, bool, str], EntryMeta] | None = None
            for n, t in after.get(j, ()):
                if n < r or (need_window and not t.window):
                    continue
                if need_snapshot and not (t.snapshot and len(t.tokens) == r):
                    continue
                rank = (isinstance(t, Entry), len(t.tokens) == r, t.kind == KIND_TAIL, t.id)
                if best is None or rank > best[0]:
                    best = (rank, t)
            if best is None:
                return None
            tail = best[1]
        return Plan(P, frozenset(cut), tuple(sorted(need)), tail, r if tail is not None else 0)
