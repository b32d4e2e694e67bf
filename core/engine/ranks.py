"""The engine's rank seams (docs/DESIGN.md §19): the points where a job's steps meet the other ranks.

One model across several ranks: rank 0's engine sends each job to the workers and every
rank runs the same steps on its shard, agreeing at these seams (the load, the prefill
chunk, the restore position, cancels, sampled tokens, stats). :mod:`.distributed` does the
transport; here is only what the engine asks of it. Each method is a no-op (or the
one-rank behaviour) when the engine runs alone (docs/DESIGN.md §19).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from ..api import Failed, GenerateRequest, RankStats, RequestHandle
from ..cache.plans import Restored
from ..cache.request import CacheRequest, ColdRequest
from ..memory import prefill as prefill_mod
from . import distributed as dist


class RankSeams:
    """The rank path of :class:`~.engine.Engine`, mixed into it.

    Runs on the engine thread (``_rank_timeout`` on the rank watchdog's). Uses the
    engine's ``ranks``, ``rank_stats``, ``cache``, ``monitor``, ``_handle``,
    ``_restored_by``, ``_on_log``, ``_plan_chunk`` and ``_make_cache``.
    """

    def _join_ranks(self) -> dist.Ranks | None:
        """This process's ranks (joined on the first load), or None when alone.

        Raises:
            dist.RankError: the ranks failed before (a rank lost or silent).
        """
        if self.ranks is None and dist.launched():
            self.ranks = dist.current()
            if self.ranks is not None:
                self.ranks.on_timeout = self._rank_timeout
        if self.ranks is not None and self.ranks.failed:
            raise dist.RankError(self.ranks.failed)
        return self.ranks

    def _send_to_ranks(self, message: dict) -> None:
        """Rank 0: send ``message`` to every worker (a no-op elsewhere, or once the ranks
        failed)."""
        r = self.ranks
        if r is None or not r.is_main or r.failed:
            return
        with r.section(f"sending {message['op']}"):
            r.broadcast(message)

    def _watched(self, stage: str):
        return self.ranks.section(stage) if self.ranks is not None else contextlib.nullcontext()

    def _rank_timeout(self, message: str) -> None:
        # the watchdog thread: the engine thread is blocked in a collective
        self._on_log(message)
        handle = self._handle
        if handle is not None and not handle.done:
            handle.emit(Failed(message, kind="error"))

    def _agree_loaded(self, load: Callable[[], Any]) -> Any:
        """``load()`` on every rank; raises ModelError on all of them when any failed."""
        from ..models.loading import ModelError

        if self.ranks is None:
            return load()
        loaded, why = None, ""
        try:
            loaded = load()
        except Exception as exc:  # noqa: BLE001 -- reported below, on every rank
            why = str(exc)
        oks = [row[0] for row in self.ranks.gather([int(loaded is not None)])]
        failed = [r for r, ok in enumerate(oks) if not ok]
        if failed:
            ranks = ", ".join(map(str, failed))
            raise ModelError(why or f"rank {ranks} could not load the model (see its log)")
        return loaded

    def _share_request(self, req: GenerateRequest, handle: RequestHandle) -> bool:
        """Rank 0: send ``req`` to the workers (after the checks that fail a request on
        rank 0 alone). False (the handle failed) when the ranks failed before."""
        r = self.ranks
        if r is None or not r.is_main:
            return True
        if r.failed:
            handle.emit(Failed(r.failed, kind="error"))
            return False
        self._send_to_ranks({"op": "generate", "request": dataclasses.asdict(req)})
        return True

    def _agreed_chunk(self, n: int) -> int:
        """:meth:`_plan_chunk`, the smallest over the ranks (one schedule on all).

        Raises:
            prefill_mod.PrefillRefused: a rank has no chunk that fits its memory.
        """
        refused = None
        try:
            chunk = self._plan_chunk(n)
        except prefill_mod.PrefillRefused as exc:
            chunk, refused = 0, exc
        if self.ranks is None:
            if refused is not None:
                raise refused
            return chunk
        agreed = self.ranks.all_min(chunk)[0]
        if agreed == 0:
            raise refused or prefill_mod.PrefillRefused(0, 0, 0, n - 1)
        return agreed

    def _restore(self, turn: CacheRequest | ColdRequest, points: list[int]):
        """The restore of a request on every rank at one position (a ``Restored``).

        Each rank holds its own shard's K/V and states, so each restores from its own
        tiers, at a position all of them can reach: the ranks plan (no loads) with a
        limit ``m`` (``N - 1`` first), take the smallest position any of them can plan,
        and repeat with it until every rank plans exactly ``m`` (state layers land only on
        a snapshot, so one round may not do: a fixpoint, ``m`` falls every round). Then
        each restores with ``max_position=m``. A rank whose load fails there (a file
        lost since the index was read) lands lower: the ranks restore once more at the
        lowest, and start cold if they still differ.

        The same prompt again (every rank's resident cache can be cut back to all of it,
        with the logprobs kept from before) restores it whole on every rank, or on none:
        a rank that could hands its resident back, cut to the prompt, and the ranks
        restore ``N - 1`` as above."""
        r = self.ranks
        cache = turn.cache if isinstance(turn, CacheRequest) else None
        prompt = turn.prompt if cache is not None else []
        repeat = cache.restore_repeat(prompt) if cache is not None else None
        if r.all_min(int(repeat is not None))[0]:
            self._restored_by = dict(repeat.cached_by)
            return repeat
        if repeat is not None:
            cache.set_resident(prompt, repeat.caches, len(prompt), repeat.first_logprobs)
        m = len(prompt) - 1
        for _ in range(64):
            plan = cache.plan(prompt, turn.ids, points, cache.resident, m) if m > 0 else None
            lo = r.all_min(plan.position if plan is not None else 0)[0]
            if lo == m or lo <= 0:
                m = max(lo, 0)
                break
            m = lo
        else:
            m = 0
        for _ in range(2):
            if cache is not None:
                turn.max_position = m
            restored = turn.restore()
            lo, neg_hi = r.all_min([restored.position, -restored.position])
            if lo == -neg_hi:
                break
            if cache is not None:
                cache.log(f"ranks restored {lo} to {-neg_hi} tokens: again at {lo}")
            m = lo
        else:
            if cache is not None:
                cache.log("ranks still differ after a second restore: cold on every rank")
            restored = Restored(caches=self._make_cache())
        self._restored_by = dict(restored.cached_by)
        return restored

    def _cancelled(self, handle: RequestHandle) -> bool:
        """Whether to stop the prefill: rank 0's cancel, on every rank."""
        r = self.ranks
        if r is None:
            return handle.cancelled
        return r.all_max(int(r.is_main and handle.cancelled))[0] > 0

    def _share_sampler(self, sampler, handle: RequestHandle):
        """``(sampler, stop flags)``: rank 0's tokens and cancels on every rank
        (:meth:`dist.Ranks.share_sampler`); ``(sampler, None)`` when alone."""
        if self.ranks is None:
            return sampler, None
        return self.ranks.share_sampler(sampler, lambda: handle.cancelled)

    def _stopped(self, handle: RequestHandle, flags, i: int) -> bool:
        """Whether decode stops after token ``i``: the cancel rank 0 sent with it."""
        if flags is None:
            return handle.cancelled
        self.ranks.tick()
        return bool(flags[i].item())

    def _clear_tier(self, tier: str) -> str:
        """Clear ``tier`` of this rank's cache (rank 0 sent the same to every worker)."""
        msg = self.cache.clear(tier) if self.cache is not None else f"cleared {tier}: no cache"
        if self.ranks is not None:
            self._gather_rank_stats()
            msg += f" (on each of {self.ranks.size} ranks)"
        return msg

    def _close_model(self) -> None:
        """A worker's side of rank 0's engine closing: flush and drop the model."""
        if self.cache is not None:
            self.cache.close()
        self.cache, self.loaded, self.model_name, self.supported = None, None, "", None
        self._restored_by = {}

    def _gather_rank_stats(self) -> None:
        """Every rank's cache and memory figures, into ``rank_stats`` (on every rank)."""
        r = self.ranks
        if r is None or r.failed:
            return
        cache, mem = self.cache, self.monitor.stats()
        hot, ssd = (cache.hot, cache.ssd) if cache is not None else (None, None)
        mine = RankStats(
            rank=r.rank,
            hot_bytes=hot.nbytes if hot is not None else 0,
            hot_max_bytes=hot.max_bytes if hot is not None else 0,
            hot_entries=len(hot) if hot is not None else 0,
            ssd_bytes=ssd.nbytes if ssd is not None else 0,
            ssd_max_bytes=ssd.max_bytes if ssd is not None else 0,
            ssd_entries=len(ssd) if ssd is not None else 0,
            memory_active_bytes=mem.active,
            memory_limit_bytes=mem.limit,
            memory_level=mem.level,
            cached_hot=self._restored_by.get("hot", 0),
            cached_ssd=self._restored_by.get("ssd", 0),
        )
        with r.section("gathering rank stats"):
            rows = r.gather(dist.stats_vector(mine))
        self.rank_stats = tuple(dist.stats_from_vector(i, row) for i, row in enumerate(rows))
