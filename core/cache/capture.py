"""What a request stores: entries captured from the live cache after each prefill chunk
and at the end (blocks, tails, sequence ends, checkpoints and state snapshots), completed
once the first token is known (docs/DESIGN.md §8, §9). Reads the prefix cache's layout
(leaves by kind, block size, root, which entries are held) through a
:class:`~.view.CaptureView` and returns entries; committing them to the tiers stays with
the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from . import layers as L
from .blocks import (
    KIND_BLOCK,
    KIND_SEQ,
    KIND_TAIL,
    LOGPROBS,
    Entry,
    role_at,
    tail_id,
)
from .view import CaptureView


def _runs(items: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted integers: ``[1, 2, 3, 7, 8] -> [[1, 2, 3], [7, 8]]``."""
    runs: list[list[int]] = []
    for x in items:
        if runs and runs[-1][-1] == x - 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return runs


class Capture:
    """Captures entries for the prefix cache ``view`` (see the module doc)."""

    def __init__(self, view: CaptureView) -> None:
        self.view = view

    def capture(
        self,
        caches: list[Any],
        tokens: Sequence[int],
        ids: Sequence[str],
        start: int,
        end: int,
        boundaries: Sequence[tuple[int, str]] = (),
        end_kind: str | None = None,
        defer_kv: bool = False,
        logprobs: mx.array | None = None,
    ) -> list[Entry]:
        """Entries to store after the cache reached position ``end`` (= its offset).

        Every block ending in ``(start, end]`` that no tier holds with everything it can
        carry, and, when ``end_kind`` is given and ``end`` is not a block end, an entry of
        that kind for ``[floor(end / bs) * bs, end)``. Only entries ending at ``end`` get
        state snapshots. The arrays are lazy: evaluate them with the chunk (one eval), then
        :meth:`commit`. ``defer_kv``: leave out the KV leaves' slices, which the live
        cache keeps anyway; :meth:`complete` adds them later (after the first token), so
        a prefill copies only what a later chunk would overwrite (windows, states).
        ``logprobs``: the first reply token's logprobs (shape ``(vocab,)``) when ``end`` is
        the end of the prompt ``tokens``; a prompt tail (``KIND_TAIL``) then keeps them
        (where they match ``spec[LOGPROBS]``), so a restore reaches the whole prompt.
        """
        bs = self.view.block_size
        live = L.leaf_map(caches)
        todo = []
        for j in range(start // bs, end // bs):
            h = self.view.held(ids[j])
            if (
                h is not None
                and (h.window or not self.view.window)
                and (h.snapshot or not ((j + 1) * bs == end and self.view.state))
            ):
                held = self.view.hot_entry(ids[j])
                if held is not None:
                    self.view.repair(held)
                continue
            todo.append(j)
        out = []
        for run in _runs(todo):
            parts = {j: {} for j in run}
            complete = dict.fromkeys(run, True)
            for leaf in self.view.window if defer_kv else self.view.kv + self.view.window:
                c = live[leaf.name]
                got = leaf.capture_blocks(c, run[0] * bs, len(run), bs)
                if got is None:  # a window no longer holds the run's start: block by block
                    got = [leaf.capture(c, j * bs, (j + 1) * bs) for j in run]
                for j, arrays in zip(run, got, strict=True):
                    if arrays is None:
                        complete[j] = False
                    else:
                        parts[j].update({f"{leaf.name}.{k}": a for k, a in arrays.items()})
            for j in run:
                at_end = (j + 1) * bs == end
                snap = at_end and bool(self.view.state)
                if snap:
                    parts[j].update(self._snapshot(live))
                out.append(
                    Entry(
                        id=ids[j],
                        parent=ids[j - 1] if j else self.view.root,
                        kind=KIND_BLOCK,
                        start=j * bs,
                        tokens=tuple(tokens[j * bs : (j + 1) * bs]),
                        role=role_at(boundaries, (j + 1) * bs),
                        window=complete[j] or not self.view.window,
                        snapshot=snap,
                        arrays=parts[j],
                    )
                )
        j = end // bs
        if end_kind is not None and end % bs:
            parent = ids[j - 1] if j else self.view.root
            seg = tuple(tokens[j * bs : end])
            tid = tail_id(parent, seg)
            keep = None
            if end_kind == KIND_TAIL and end == len(tokens) and self._fits(logprobs):
                keep = logprobs
            held = self.view.hot_entry(tid, touch=True)
            if held is not None and (keep is None or held.logprobs):
                self.view.repair(held)
            else:
                role = "assistant" if end_kind == KIND_SEQ else role_at(boundaries, end)
                e = self._entry(live, tid, parent, end_kind, j * bs, seg, role, True, defer_kv)
                if keep is not None:
                    e.arrays[LOGPROBS], e.logprobs = keep, True
                out.append(e)
        return out

    def _fits(self, logprobs: Any) -> bool:
        """Whether first-token ``logprobs`` have the shape and dtype entries keep."""
        spec = self.view.logprobs_spec
        return (
            logprobs is not None
            and spec is not None
            and tuple(logprobs.shape) == tuple(spec[0])
            and logprobs.dtype == spec[1]
        )

    def complete(self, caches: list[Any], entries: list[Entry]) -> None:
        """Add the KV leaves' slices to entries captured with ``defer_kv`` (the live cache
        must still hold their tokens), evaluate them in one eval and :meth:`commit`."""
        if not entries:
            return
        bs = self.view.block_size
        live = L.leaf_map(caches)
        blocks = {e.start // bs: e for e in entries if e.kind == KIND_BLOCK}
        new, lost = [], set()
        for run in _runs(sorted(blocks)):
            for leaf in self.view.kv:
                c = live[leaf.name]
                got = leaf.capture_blocks(c, run[0] * bs, len(run), bs)
                if got is None:
                    got = [leaf.capture(c, j * bs, (j + 1) * bs) for j in run]
                for j, arrays in zip(run, got, strict=True):
                    if arrays is None:  # the live cache lost it: never store a partial entry
                        lost.add(blocks[j].id)
                        continue
                    named = {f"{leaf.name}.{k}": a for k, a in arrays.items()}
                    blocks[j].arrays.update(named)
                    new.extend(named.values())
        for e in entries:
            if e.kind == KIND_BLOCK:
                continue
            for leaf in self.view.kv:
                got = leaf.capture(live[leaf.name], e.start, e.end)
                if got is None:
                    lost.add(e.id)
                    break
                named = {f"{leaf.name}.{k}": a for k, a in got.items()}
                e.arrays.update(named)
                new.extend(named.values())
        mx.eval(new)
        self.view.commit([e for e in entries if e.id not in lost])

    def _snapshot(self, live) -> dict:
        arrays = {}
        for leaf in self.view.state:
            arrays.update(
                {f"{leaf.name}.{k}": a for k, a in leaf.snapshot(live[leaf.name]).items()}
            )
        return arrays

    def _entry(self, live, eid, parent, kind, start, tokens, role, at_end, defer_kv=False):
        arrays, window_ok = {}, True
        end = start + len(tokens)
        for leaf in self.view.window if defer_kv else self.view.kv + self.view.window:
            got = leaf.capture(live[leaf.name], start, end)
            if got is None:
                window_ok = False
                continue
            arrays.update({f"{leaf.name}.{k}": a for k, a in got.items()})
        snap = at_end and bool(self.view.state)
        if snap:
            arrays.update(self._snapshot(live))
        return Entry(
            id=eid,
            parent=parent,
            kind=kind,
            start=start,
            tokens=tuple(tokens),
            role=role,
            window=window_ok or not self.view.window,
            snapshot=snap,
            arrays=arrays,
        )
