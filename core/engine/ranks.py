"""The engine's peers (docs/DESIGN.md §19): the points where a job's steps meet the other ranks.

One model across several ranks: rank 0's engine sends each job, each request and each of
its scheduler's actions to the workers, and every rank runs the same steps on its shard,
agreeing at these seams (the load; a request's start: its chunk, the request itself and
its restore position, in one exchange; its prefill's success before anything is stored;
sampled tokens; stats). The engine holds one *peers* object and calls it at each seam:

- :class:`OneProcess`: the engine runs alone; every seam is a no-op or the one-rank answer
  (the request's own restore, this process's chunk, its own tokens).
- :class:`RankGroup`: several ranks over :class:`~.distributed.Ranks` (the transport);
  each seam is a collective that every rank makes in the same order.

Both take what they need from the engine as arguments (the chunk plan, the request's
cache object, the cache and memory figures); neither holds the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

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

# what a rank says of a request's prefill before anything is stored (docs/DESIGN.md §19)
PREFILL_OK = 0
PREFILL_FAILED = 1  # its own work raised (a capture, a test's fault): the request fails
RESTORE_SHORT = 2  # its restore landed below the agreed position: the request starts again
# the deepest positions each rank offers in the start's one exchange
REACHABLE = 4


class Agreed(NamedTuple):
    """A request's start as every rank agreed it: the prefill ``chunk`` (tokens), the
    request's cache object and its restore (``short``: this rank's restore landed below
    the agreed position, its caches hold less than ``restored.position`` tokens)."""

    chunk: int
    turn: Turn
    restored: Restored
    short: bool = False


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
    def start(
        self,
        plan: Callable[[], int],
        open_turn: Callable[[int], Turn],
        n: int,
        digest: int,
        cold: bool = False,
    ) -> Agreed: ...
    def agree_prefill(
        self, sampler: Sampler, logprobs: Any, failure: int
    ) -> tuple[int | None, tuple[int, ...]]: ...
    def agree_ok(self, failure: int) -> tuple[int, ...]: ...
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

    def start(
        self,
        plan: Callable[[], int],
        open_turn: Callable[[int], Turn],
        n: int,
        digest: int,
        cold: bool = False,
    ) -> Agreed:
        """``plan()`` (the prefill chunk that fits this process's memory), the request's
        cache object ``open_turn(chunk)`` and its own restore.

        Raises:
            prefill_mod.PrefillRefused: no chunk fits.
        """
        chunk = plan()
        turn = open_turn(chunk)
        try:
            return Agreed(chunk, turn, turn.restore(max_position=0 if cold else None))
        except BaseException:
            turn.close()
            raise

    def agree_prefill(
        self, sampler: Sampler, logprobs: Any, failure: int
    ) -> tuple[int | None, tuple[int, ...]]:
        tok = int(sampler(logprobs[None]).item()) if logprobs is not None else None
        return tok, (failure,)

    def agree_ok(self, failure: int) -> tuple[int, ...]:
        return (failure,)

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

    def start(
        self,
        plan: Callable[[], int],
        open_turn: Callable[[int], Turn],
        n: int,
        digest: int,
        cold: bool = False,
    ) -> Agreed:
        """A request's start on every rank in one exchange (docs/DESIGN.md §9, §19): the
        prefill chunk, the request itself and the restore position.

        ``n``: the prompt's tokens; ``cold``: restore nothing (the request's second start
        after a short restore). Each rank plans its chunk (``plan()``, its memory), opens
        the request's cache object (``open_turn(chunk)``), lists the deepest positions it
        can restore (:func:`reachable`, plans only, no loads) and whether it can take the
        same prompt again whole (its resident cache cut back), and adds them with
        ``digest`` (the request's, :func:`.actions.digest`) to one ``gather`` of
        ``4 + REACHABLE`` integers a rank. Every rank then reads the same rows: the smallest
        chunk (0: refused everywhere), the whole prompt when every rank can, else the
        deepest position every rank listed, and restores there. Each rank holds its own
        shard's K/V and states, so each restores from its own tiers.

        Where that one exchange cannot decide -- the ranks planned different chunks (so
        different schedules), or the lists share no position while each is full -- the
        ranks fall back to a fixpoint over positions (:meth:`_fixpoint`). A rank whose
        load fails at the agreed position (a file lost since the index was read) lands
        lower: it says so (``short``), prefills the same pieces as the others, and the
        prefill's agreement (:meth:`agree_prefill`) starts the request again, cold.

        Raises:
            prefill_mod.PrefillRefused: a rank has no chunk that fits its memory.
            dist.RankError: the ranks hold different requests (out of step).
        """
        refused, turn = None, None
        try:
            own = plan()
        except prefill_mod.PrefillRefused as exc:
            own, refused = 0, exc
        try:
            if own:
                turn = open_turn(own)
            listed = reachable(turn, n - 1) if turn is not None and not cold else []
            repeat = int(turn is not None and not cold and turn.offer_repeat())
            row = [own, digest, repeat, len(listed), *listed, *[0] * (REACHABLE - len(listed))]
            rows = self.ranks.gather(row)
            chunk = min(r[0] for r in rows)
            if len({r[1] for r in rows}) > 1:
                raise dist.RankError("the ranks are out of step: they start different requests")
            if chunk == 0:
                raise refused or prefill_mod.PrefillRefused(0, 0, 0, n - 1)
            if any(r[0] != chunk for r in rows):  # another schedule: plan again under it
                turn.decline_repeat()
                if own != chunk:
                    turn.close()
                    turn = open_turn(chunk)
                return self._agreed(chunk, turn, self._fixpoint(turn, n - 1))
            if all(r[2] for r in rows):
                return self._agreed(chunk, turn, turn.restore())
            turn.decline_repeat()
            lists = [set(r[4 : 4 + r[3]]) for r in rows]
            common = set.intersection(*lists)
            if common:
                m = max(common)
            elif all(r[3] == REACHABLE for r in rows):  # deeper lists than were sent
                m = self._fixpoint(turn, min(min(x) for x in lists) - 1, restore=False)
            else:
                m = 0
            restored = turn.restore(max_position=m)
            if restored.position < m:
                turn.log(f"restored {restored.position} of the {m} tokens the ranks agreed")
                return self._agreed(chunk, turn, dataclasses.replace(restored, position=m), True)
            return self._agreed(chunk, turn, restored)
        except BaseException:
            if turn is not None:
                turn.close()
            raise

    def _agreed(self, chunk: int, turn: Turn, restored: Restored, short: bool = False) -> Agreed:
        self._restored_by = dict(restored.cached_by)
        return Agreed(chunk, turn, restored, short)

    def _fixpoint(self, turn: Turn, m: int, restore: bool = True) -> Any:
        """The restore position by rounds of ``all_min`` (the fallback of :meth:`start`):
        the ranks plan with a limit ``m``, take the smallest position any of them can
        plan, and repeat with it until every rank plans exactly ``m`` (state layers land
        only on a snapshot, so one round may not do: ``m`` falls every round). Then
        (``restore``) each restores at most ``m``; a rank whose load fails there lands
        lower, and the ranks restore once more at the lowest, and start cold if they still
        differ. Returns the :class:`Restored`, or the position when not ``restore``."""
        all_min = self.ranks.all_min
        for _ in range(64):
            lo = all_min(turn.plan_position(m))[0]
            if lo == m or lo <= 0:
                m = max(lo, 0)
                break
            m = lo
        else:
            m = 0
        if not restore:
            return m
        for _ in range(2):
            restored = turn.restore(max_position=m)
            lo, neg_hi = all_min([restored.position, -restored.position])
            if lo == -neg_hi:
                return restored
            turn.log(f"ranks restored {lo} to {-neg_hi} tokens: again at {lo}")
            m = lo
        turn.log("ranks still differ after a second restore: cold on every rank")
        return turn.restore_cold()

    def agree_prefill(
        self, sampler: Sampler, logprobs: Any, failure: int
    ) -> tuple[int | None, tuple[int, ...]]:
        """A prefill's end on every rank, before anything of it is stored: rank 0's first
        token sampled by ``sampler`` from ``logprobs`` (shape ``(vocab,)``; None: the
        first token comes from the first decode step) and every rank's ``failure``
        (:data:`PREFILL_OK`, :data:`PREFILL_FAILED`, :data:`RESTORE_SHORT`), in one
        ``all_sum`` of a ``(1 + size,)`` vector. Returns the token (None without
        ``logprobs`` on rank 0) and the failures by rank."""
        r = self.ranks
        _settle()
        mine = [0] * (1 + r.size)
        mine[1 + r.rank] = failure
        row = mx.array(mine, dtype=mx.int32)
        has_token = r.is_main and logprobs is not None
        if has_token:
            tok = sampler(logprobs[None]).astype(mx.int32).reshape(1)
            row = mx.concatenate([tok, row[1:]])
        with r.section("agreeing on a prefill"):
            got = r.sum_ints(row)
        return (got[0] if logprobs is not None or not r.is_main else None), tuple(got[1:])

    def agree_ok(self, failure: int) -> tuple[int, ...]:
        """Every rank's ``failure`` (as :meth:`agree_prefill`) by rank, in one ``all_sum``:
        before a cancelled prefill stores what it computed."""
        r = self.ranks
        _settle()
        mine = [0] * r.size
        mine[r.rank] = failure
        with r.section("agreeing on a cancelled prefill"):
            return tuple(r.sum_ints(mx.array(mine, dtype=mx.int32)))

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


def reachable(turn: Turn, limit: int, k: int = REACHABLE) -> list[int]:
    """The ``k`` deepest positions, at most ``limit``, that ``turn`` can restore now,
    deepest first, from its plans (``plan_position``; nothing is loaded)."""
    out: list[int] = []
    p = turn.plan_position(limit) if limit > 0 else 0
    while p > 0 and len(out) < k:
        out.append(p)
        p = turn.plan_position(p - 1)
    return out


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
