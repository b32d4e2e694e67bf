"""The engine's peers (docs/DESIGN.md §19): the points where a job's steps meet the other ranks.

One model across several ranks: rank 0's engine sends each job, each request and each of
its scheduler's actions to the workers, and every rank runs the same steps on its shard,
agreeing at these seams (the load, the prefill chunk, the restore position, sampled
tokens, stats). The engine holds one *peers* object and calls it at each seam:

- :class:`OneProcess`: the engine runs alone; every seam is a no-op or the one-rank answer
  (the request's own restore, this process's chunk, its own tokens).
- :class:`RankGroup`: several ranks over :class:`~.distributed.Ranks` (the transport);
  each seam is a collective that every rank makes in the same order.

Both take what they need from the engine as arguments (the chunk plan, the request's
cache object, the cache and memory figures); neither holds the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..api import GenerateRequest, MemoryStats, RankStats
from ..cache.plans import Restored
from ..cache.request import CacheRequest, ColdRequest
from ..memory import prefill as prefill_mod
from . import distributed as dist
from .actions import Admit, Message, encode, op_name

Turn = CacheRequest | ColdRequest
Sampler = Callable[[Any], Any]  # logprobs (..., vocab) -> tokens (...)


class Peers(Protocol):
    """What the engine asks of its peers (docs/DESIGN.md §19); on the engine thread."""

    size: int  # ranks in the group (1: alone)
    is_main: bool  # rank 0 (or alone): runs the command, samples, takes cancels
    group: Any  # the MLX group to shard the model over, or None
    failed: str  # why the ranks are out of service ("": they are not)
    stats: tuple[RankStats, ...]  # every rank's figures, as last gathered (() alone)

    def send(self, message: Message) -> None: ...
    def watched(self, stage: str) -> contextlib.AbstractContextManager: ...
    def out_of_step(self, exc: BaseException) -> None: ...
    def all_min(self, values: list[int]) -> list[int]: ...
    def agree_loaded(self, load: Callable[[], Any]) -> Any: ...
    def share_request(self, req: GenerateRequest, uid: int) -> None: ...
    def agree_chunk(self, plan: Callable[[], int], n: int) -> int: ...
    def restore(self, turn: Turn) -> Restored: ...
    def share_tokens(self, sampler: Sampler) -> Sampler: ...
    def gather_stats(self, cache: Any, memory: Callable[[], MemoryStats]) -> None: ...
    def on_every_rank(self, report: str) -> str: ...
    def forget_restore(self) -> None: ...


class OneProcess:
    """The engine alone: one rank, no collectives (docs/DESIGN.md §19)."""

    size = 1
    is_main = True
    group = None
    failed = ""
    stats: tuple[RankStats, ...] = ()

    def send(self, message: Message) -> None:
        pass

    def watched(self, stage: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def out_of_step(self, exc: BaseException) -> None:
        pass

    def all_min(self, values: list[int]) -> list[int]:
        return list(values)

    def agree_loaded(self, load: Callable[[], Any]) -> Any:
        return load()

    def share_request(self, req: GenerateRequest, uid: int) -> None:
        pass

    def agree_chunk(self, plan: Callable[[], int], n: int) -> int:
        """``plan()``: the prefill chunk (tokens) that fits this process's memory.

        Raises:
            prefill_mod.PrefillRefused: none fits.
        """
        return plan()

    def restore(self, turn: Turn) -> Restored:
        return turn.restore()

    def share_tokens(self, sampler: Sampler) -> Sampler:
        return sampler

    def gather_stats(self, cache: Any, memory: Callable[[], MemoryStats]) -> None:
        pass

    def on_every_rank(self, report: str) -> str:
        return report

    def forget_restore(self) -> None:
        pass


class RankGroup:
    """Several ranks (docs/DESIGN.md §19): each seam a collective over ``ranks``.

    ``on_timeout(message)`` is called from the rank watchdog's thread when a rank stops
    answering (the engine fails the request in flight). Every method that communicates
    is called by every rank, in the same order, on the engine thread.
    """

    def __init__(self, ranks: dist.Ranks, on_timeout: Callable[[str], None]) -> None:
        self.ranks = ranks
        ranks.on_timeout = on_timeout
        self.stats: tuple[RankStats, ...] = ()
        self._restored_by: dict[str, int] = {}  # the tokens this rank's last restore took

    @property
    def size(self) -> int:
        return self.ranks.size

    @property
    def is_main(self) -> bool:
        return self.ranks.is_main

    @property
    def group(self) -> Any:
        return self.ranks.group

    @property
    def failed(self) -> str:
        return self.ranks.failed

    def send(self, message: Message) -> None:
        """Rank 0: send ``message`` (a typed record, :mod:`.actions`, in its wire form) to
        every worker (a no-op elsewhere, or once the ranks failed)."""
        r = self.ranks
        if not r.is_main or r.failed:
            return
        _settle()
        with r.section(f"sending {op_name(message)}"):
            r.broadcast(encode(message))

    def watched(self, stage: str) -> contextlib.AbstractContextManager:
        """Rank 0's watchdog over ``stage`` (:meth:`dist.Ranks.section`)."""
        return self.ranks.section(stage)

    def out_of_step(self, exc: BaseException) -> None:
        """A job raised: the other ranks may be anywhere in it now, so the group fails."""
        if not self.ranks.failed:
            self.ranks.failed = dist.failure_of(exc)

    def all_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum over the ranks (:meth:`dist.Ranks.all_min`)."""
        return self.ranks.all_min(values)

    def agree_loaded(self, load: Callable[[], Any]) -> Any:
        """``load()`` on every rank; raises ModelError on all of them when any failed."""
        from ..models.loading import ModelError

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

    def share_request(self, req: GenerateRequest, uid: int) -> None:
        """Rank 0: queue ``req`` in the workers' schedulers too, as its own request ``uid``
        (docs/DESIGN.md §20)."""
        self.send(Admit(uid, req))

    def agree_chunk(self, plan: Callable[[], int], n: int) -> int:
        """``plan()`` (this rank's chunk for an ``n``-token prompt), the smallest over the
        ranks: one schedule on all.

        Raises:
            prefill_mod.PrefillRefused: a rank has no chunk that fits its memory.
        """
        refused = None
        try:
            chunk = plan()
        except prefill_mod.PrefillRefused as exc:
            chunk, refused = 0, exc
        agreed = self.ranks.all_min(chunk)[0]
        if agreed == 0:
            raise refused or prefill_mod.PrefillRefused(0, 0, 0, n - 1)
        return agreed

    def restore(self, turn: Turn) -> Restored:
        """The restore of a request on every rank at one position, through its cache
        object (docs/DESIGN.md §9, §19).

        Each rank holds its own shard's K/V and states, so each restores from its own
        tiers, at a position all of them can reach: the ranks plan (no loads) with a
        limit ``m`` (``N - 1`` first), take the smallest position any of them can plan,
        and repeat with it until every rank plans exactly ``m`` (state layers land only on
        a snapshot, so one round may not do: a fixpoint, ``m`` falls every round). Then
        each restores at most ``m``. A rank whose load fails there (a file lost since the
        index was read) lands lower: the ranks restore once more at the lowest, and start
        cold if they still differ.

        The same prompt again (every rank's resident cache can be cut back to all of it,
        with the logprobs kept from before) restores it whole on every rank, or on none:
        a rank that could hands its resident back, cut to the prompt, and the ranks
        restore ``N - 1`` as above."""
        all_min = self.ranks.all_min
        if all_min(int(turn.offer_repeat()))[0]:
            return self._restored(turn.restore())
        turn.decline_repeat()
        m = len(turn.prompt) - 1
        for _ in range(64):
            lo = all_min(turn.plan_position(m))[0]
            if lo == m or lo <= 0:
                m = max(lo, 0)
                break
            m = lo
        else:
            m = 0
        for _ in range(2):
            restored = turn.restore(max_position=m)
            lo, neg_hi = all_min([restored.position, -restored.position])
            if lo == -neg_hi:
                return self._restored(restored)
            turn.log(f"ranks restored {lo} to {-neg_hi} tokens: again at {lo}")
            m = lo
        turn.log("ranks still differ after a second restore: cold on every rank")
        return self._restored(turn.restore_cold())

    def _restored(self, restored: Restored) -> Restored:
        self._restored_by = dict(restored.cached_by)
        return restored

    def forget_restore(self) -> None:
        """The model closed: no last restore to report."""
        self._restored_by = {}

    def share_tokens(self, sampler: Sampler) -> Sampler:
        """``sampler`` whose tokens are rank 0's on every rank, inside the step's graph
        (:meth:`dist.Ranks.share_tokens`)."""
        return self.ranks.share_tokens(sampler)

    def on_every_rank(self, report: str) -> str:
        """A clear's ``report``, saying that every rank did the same."""
        return f"{report} (on each of {self.size} ranks)"

    def gather_stats(self, cache: Any, memory: Callable[[], MemoryStats]) -> None:
        """Every rank's cache (a :class:`~.cache.prefix.PrefixCache` or None) and memory
        (``memory()``) figures, into :attr:`stats` (on every rank; skipped once the ranks
        failed)."""
        r = self.ranks
        if r.failed:
            return
        mem, hot, ssd = memory(), None, None
        if cache is not None:
            hot, ssd, *_ = cache.tier_stats()
        mine = RankStats(
            rank=r.rank,
            hot_bytes=hot.nbytes if hot is not None else 0,
            hot_max_bytes=hot.max_bytes if hot is not None else 0,
            hot_entries=hot.entries if hot is not None else 0,
            ssd_bytes=ssd.nbytes if ssd is not None else 0,
            ssd_max_bytes=ssd.max_bytes if ssd is not None else 0,
            ssd_entries=ssd.entries if ssd is not None else 0,
            memory_active_bytes=mem.active,
            memory_limit_bytes=mem.limit,
            memory_level=mem.level,
            cached_hot=self._restored_by.get("hot", 0),
            cached_ssd=self._restored_by.get("ssd", 0),
        )
        _settle()
        with r.section("gathering rank stats"):
            rows = r.gather(dist.stats_vector(mine))
        self.stats = tuple(dist.stats_from_vector(i, row) for i, row in enumerate(rows))


def _settle() -> None:
    """Wait for the graph in flight on the generation stream (a decode step computed ahead,
    with the model's collectives and the shared tokens' ``all_sum``): a collective made
    outside it (a message, the stats) then meets its peers' in the same order on every
    rank, whatever stream each runs on."""
    mx.synchronize(generation_stream)


def join(on_timeout: Callable[[str], None]) -> RankGroup | None:
    """This process's :class:`RankGroup` when it was launched as one of several ranks
    (joining the group on the first call), else None. On the engine thread.

    Raises:
        dist.RankError: launched, but the group could not be joined.
    """
    ranks = dist.current() if dist.launched() else None
    return RankGroup(ranks, on_timeout) if ranks is not None else None
