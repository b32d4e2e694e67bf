"""One request's use of the prefix cache: the per-request cache protocol.

The engine does the model work (forwards, sampling); a :class:`CacheRequest` does all the
cache needs around it, in the order a request meets it (docs/DESIGN.md §9)::

    req = prefix_cache.begin(prompt, points, boundaries, fresh)  # the SSD writer waits
    restored = req.restore()                   # resident cut, hot / SSD entries, or fresh
    for end in chunk_ends(restored.position, points):
        model(prompt[pos:end], cache=caches)   # at N (folded): the first token's logprobs
        mx.eval(states + req.chunk(caches, pos, end, logprobs))  # windows, states, tail
    req.first_token(caches)                    # the KV slices, then the writer resumes
    req.finish(caches, prompt + reply, first_logprobs)  # store the end, keep it resident
    req.close()                                # always (``finally``); or req.cancel(...)

as mlx-lm's server uses its ``LRUPromptCache`` through two calls (``fetch_nearest_cache``,
``insert_cache``). Ranks agree on the restore through the same object (``offer_repeat``,
``decline_repeat``, ``plan_position``, then ``restore(max_position=m)``; docs/DESIGN.md
§19). :class:`ColdRequest` has the same methods and keeps nothing: a request with the cache
off runs the same code.

Everything here runs on the engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .blocks import KIND_BOUNDARY, KIND_SEQ, KIND_TAIL
from .plans import Restored
from .stats import uncounted

if TYPE_CHECKING:
    from .prefix import PrefixCache


class CacheRequest:
    """A prompt's restore, per-chunk capture and store in one :class:`PrefixCache`.

    ``prompt``: token ids (``N`` of them); ``points``: its prefill schedule
    (:func:`~.schedule.schedule_points`); ``boundaries``: message ends ``(offset, role)``;
    ``fresh``: makes a new cache list (``model.make_cache``); ``max_position``: restore no
    further than this many tokens (ranks that must agree on one position; None: no limit).
    The SSD writer is paused from construction to :meth:`first_token` (or :meth:`close`),
    so disk writes never compete with the time to first token.
    """

    def __init__(
        self,
        cache: PrefixCache,
        prompt: Sequence[int],
        points: Sequence[int],
        boundaries: Sequence[tuple[int, str]],
        fresh: Callable[[], list[Any]],
        max_position: int | None = None,
    ) -> None:
        self.cache = cache
        self.prompt = list(prompt)
        self.points = list(points)
        self.boundaries = tuple(boundaries)
        self.fresh = fresh
        self.max_position = max_position
        self.ids = cache.ids(self.prompt)
        self.read_ssd = False  # the restore read from the SSD tier
        self.ssd_write_bytes = 0  # bytes of SSD files this request handed to the writer
        self._restored_at = time.perf_counter()
        self._position = 0
        # state models keep a checkpoint at every chunk end (message ends included)
        self._checkpoint_kind = KIND_BOUNDARY if cache.state else None
        self._deferred: list = []  # entries whose KV slices are added after the first token
        self._repeat: Restored | None = None  # the same prompt again, offered (ranks)
        self._writer_paused = cache.hold_writes(self)

    def restore(self, max_position: int | None = None) -> Restored:
        """Restore the furthest allowed cached prefix (the same prompt again: the whole of
        it, with the kept logprobs of its first token; see
        :meth:`PrefixCache.restore_repeat <.prefix.PrefixCache.restore_repeat>`), at most
        ``max_position`` tokens when given (the position ranks agreed on, docs/DESIGN.md
        §19) as well as the request's own limit."""
        n, limit = len(self.prompt), _lower(self.max_position, max_position)
        t0 = time.perf_counter()
        restored, self._repeat = self._repeat, None
        if restored is not None and limit is not None and limit < n:
            self._give_back(restored)
            restored = None
        if restored is None and (limit is None or limit >= n):
            restored = self.cache.restore_repeat(self.prompt)
        if restored is None:
            restored = self.cache.restore(
                self.prompt, self.ids, self.points, self.fresh, max_position=limit
            )
        self.read_ssd = bool(restored.cached_by.get("ssd") or restored.ssd_bytes)
        self.cache.count_lookup(restored, n)
        self._restored_at = time.perf_counter()
        self._position = restored.position
        if restored.ssd_bytes:
            self.cache.observe_read(restored.ssd_bytes, self._restored_at - t0)
        return restored

    # the steps of a restore that ranks agree on (docs/DESIGN.md §19): each rank offers
    # the same prompt again, plans positions, then restores at the one they agreed
    def offer_repeat(self) -> bool:
        """Take the resident cache cut back to the whole prompt when it is the same prompt
        again (:meth:`PrefixCache.restore_repeat <.prefix.PrefixCache.restore_repeat>`),
        held for :meth:`restore`; whether it could (never past the request's limit)."""
        n, limit = len(self.prompt), self.max_position
        if self._repeat is None and (limit is None or limit >= n):
            self._repeat = self.cache.restore_repeat(self.prompt)
        return self._repeat is not None

    def decline_repeat(self) -> None:
        """Hand a repeat taken by :meth:`offer_repeat` back as the resident cache (cut to
        the prompt): another rank could not take its own."""
        repeat, self._repeat = self._repeat, None
        if repeat is not None:
            self._give_back(repeat)

    def plan_position(self, limit: int) -> int:
        """The position a restore of at most ``limit`` tokens would land on now, from a
        plan over the resident cache and the tiers (nothing is loaded); 0 when none."""
        if limit <= 0:
            return 0
        plan = self.cache.plan(self.prompt, self.ids, self.points, self.cache.resident, limit)
        return plan.position if plan is not None else 0

    def restore_cold(self) -> Restored:
        """A fresh cache list: the ranks restored different prefixes (docs/DESIGN.md
        §19), so every rank starts cold."""
        self._position = 0
        return Restored(caches=self.fresh())

    def log(self, text: str) -> None:
        """Add ``text`` to the cache's events."""
        self.cache.log(text)

    def _give_back(self, repeat: Restored) -> None:
        n = len(self.prompt)
        self.cache.set_resident(self.prompt, repeat.caches, n, repeat.first_logprobs)

    def chunk(
        self,
        caches: list[Any],
        start: int,
        end: int,
        first_logprobs: Any = None,
        checkpoint: bool = True,
    ) -> list[mx.array]:
        """Capture what the chunk ``[start, end)`` just computed into ``caches`` (lazy):
        window slices and state snapshots, which a later chunk would overwrite, and the
        prompt's tail entry at ``N - 1`` (at ``N`` on the folded schedule, keeping
        ``first_logprobs``, the first token's logprobs of shape ``(vocab,)`` that chunk
        gave). Returns the arrays to evaluate with the chunk (one eval). KV slices wait
        for :meth:`first_token` (the live cache keeps them). ``checkpoint`` False: ``end``
        is no schedule point (a piece inside a chunk, docs/DESIGN.md §20), so no state
        checkpoint is taken there."""
        n = len(self.prompt)
        kind = KIND_TAIL if end >= n - 1 else (self._checkpoint_kind if checkpoint else None)
        entries = self.cache.capture(
            caches,
            self.prompt,
            self.ids,
            start,
            end,
            self.boundaries,
            kind,
            defer_kv=True,
            logprobs=first_logprobs if end == n else None,
        )
        self._deferred.extend(entries)
        return [a for e in entries for a in e.arrays.values()]

    def first_token(self, caches: list[Any]) -> None:
        """The first token is out: complete the entries the chunks captured (their KV
        slices), hand them to the SSD tier and let its writer run."""
        # what computing the rest cost: the prefill rate
        elapsed = time.perf_counter() - self._restored_at
        self.cache.observe_prefill(len(self.prompt) - self._position, elapsed)
        self._complete(caches)
        self.ssd_write_bytes += self.cache.persist()
        self._resume_writer()

    def cancel(self, caches: list[Any], position: int) -> int:
        """The request stopped during prefill with ``caches`` at ``position`` (a chunk end):
        keep what the finished chunks computed (their entries, and the live cache as the
        resident one, so a retry restores all ``position`` tokens in place). Returns the
        number of prompt tokens kept."""
        self._complete(caches)
        if position > 0:
            # its end too, as a finished reply's: a retry after another request (which
            # takes the resident cache) still restores every finished chunk
            self._store_end(caches, self.prompt[:position])
            self.cache.set_resident(self.prompt[:position], caches)
            self.cache.log(f"cancelled during prefill: kept {position} tokens")
        return position

    def finish(
        self,
        caches: list[Any],
        sequence: Sequence[int],
        first_logprobs: Any,
        end_logprobs: Any = None,
    ) -> None:
        """The reply ended with ``caches`` holding ``sequence`` (prompt + every yielded
        token): store its new blocks and its end, and keep it resident with the logprobs
        the first token was sampled from and, when known, those after its last token
        (``end_logprobs``, for a continue), both of shape ``(vocab,)``."""
        self._complete(caches)
        self._store_end(caches, sequence)
        self.cache.set_resident(sequence, caches, len(self.prompt), first_logprobs, end_logprobs)

    def _store_end(self, caches: list[Any], sequence: Sequence[int]) -> None:
        """Store the blocks of ``sequence`` (what ``caches`` hold) and its end entry."""
        cache = self.cache
        seq_ids = cache.ids(sequence)
        entries = cache.capture(caches, sequence, seq_ids, 0, len(sequence), (), KIND_SEQ)
        for e in entries:
            if e.kind == KIND_SEQ:
                e.prompt_end = min(len(self.prompt), len(sequence))
        mx.eval([c.state for c in caches] + [a for e in entries for a in e.arrays.values()])
        cache.commit(entries)
        self.ssd_write_bytes += cache.persist()

    def discard(self) -> None:
        """The prefill is void (a rank's failed, docs/DESIGN.md §19): drop what its chunks
        captured, store nothing of it, and let the SSD writer run."""
        self._deferred = []
        self.close()

    def close(self) -> None:
        """Hand anything committed to the SSD tier and let its writer run (idempotent)."""
        self.ssd_write_bytes += self.cache.persist()
        self._resume_writer()

    def _complete(self, caches: list[Any]) -> None:
        deferred, self._deferred = self._deferred, []
        self.cache.complete(caches, deferred)

    def _resume_writer(self) -> None:
        if self._writer_paused:
            self._writer_paused = False
            self.cache.release_writes(self)


class MeasureRequest(CacheRequest):
    """A measurement through the cache (``GenerateRequest.measure``: the cached run of a
    verify against cold, docs/DESIGN.md §18): restored as a turn would be, but no turn.

    Its restore moves no counter (the lookups behind the hit rate, the tiers', tails' and
    resident cache's hits and misses: :func:`.stats.uncounted`); it captures and stores no entry; and the resident
    cache stays as it was. The resident is handed to the restore only when it holds
    exactly ``prompt + reply`` (``whole``: the reply being measured), which the run
    rebuilds and gives back; any other resident is set aside for the restore and put
    back after it. Its reads admit no entry to the SSD tier (``PrefixCache.measuring``);
    they still refresh the hot tier's LRU order and promote an SSD entry read to it.
    """

    def __init__(
        self, cache: PrefixCache, prompt, points, boundaries, fresh, whole, max_position=None
    ) -> None:
        super().__init__(cache, prompt, points, boundaries, fresh, max_position)
        self.whole = tuple(whole)
        self._took_resident = False

    def restore(self, max_position: int | None = None) -> Restored:
        cache = self.cache
        r = cache.resident
        self._took_resident = r is not None and r.tokens == self.whole
        aside = None if self._took_resident else cache.take_resident()
        cache.log("verify: a measurement through the cache (counted nowhere, stores nothing)")
        cache.measuring = True
        try:
            with uncounted(cache):
                restored = self.cache_restore(max_position)
        finally:
            cache.measuring = False
            if aside is not None:
                cache.set_resident(
                    aside.tokens,
                    aside.caches,
                    aside.prompt_tokens,
                    aside.first_logprobs,
                    aside.end_logprobs,
                )
        self._position = restored.position
        return restored

    def cache_restore(self, max_position: int | None) -> Restored:
        """The cache's restore of the whole prompt (a repeat of the resident, else the
        furthest prefix), nothing counted by the caller's lookup."""
        limit = _lower(self.max_position, max_position)
        n = len(self.prompt)
        restored = None
        if limit is None or limit >= n:
            restored = self.cache.restore_repeat(self.prompt)
        if restored is None:
            restored = self.cache.restore(
                self.prompt, self.ids, self.points, self.fresh, max_position=limit
            )
        self.read_ssd = bool(restored.cached_by.get("ssd") or restored.ssd_bytes)
        return restored

    def offer_repeat(self) -> bool:
        return False  # ranks: a measurement restores through the plain path

    def plan_position(self, limit: int) -> int:
        """As :meth:`CacheRequest.plan_position`, over the resident cache only when the
        restore will use it (it holds ``whole``), so ranks agree on what it lands on."""
        if limit <= 0:
            return 0
        r = self.cache.resident
        resident = r if r is not None and r.tokens == self.whole else None
        plan = self.cache.plan(self.prompt, self.ids, self.points, resident, limit)
        return plan.position if plan is not None else 0

    def chunk(self, caches, start, end, first_logprobs=None, checkpoint=True) -> list[mx.array]:
        return []  # nothing is captured

    def first_token(self, caches: list[Any]) -> None:
        self._resume_writer()

    def cancel(self, caches: list[Any], position: int) -> int:
        if self._took_resident and position > 0:  # a valid cache: the resident again
            self.cache.set_resident(self.prompt[:position], caches)
        return 0

    def finish(self, caches, sequence, first_logprobs, end_logprobs=None) -> None:
        if self._took_resident:  # the same tokens it held (or fewer, stopped)
            self.cache.set_resident(
                sequence, caches, len(self.prompt), first_logprobs, end_logprobs
            )


def _lower(a: int | None, b: int | None) -> int | None:
    """The lower of two limits, either of which may be None (no limit)."""
    return b if a is None else a if b is None else min(a, b)


class ColdRequest:
    """A request with the cache off: a fresh cache list, nothing captured or kept. Holds
    the SSD writer of ``cache`` (when a cache exists) like :class:`CacheRequest`, so a
    cold request's TTFT meets the same disk."""

    read_ssd = False
    ssd_write_bytes = 0
    prompt: tuple[int, ...] = ()  # nothing of it is planned or restored

    def __init__(self, fresh: Callable[[], list[Any]], cache: PrefixCache | None = None) -> None:
        self.fresh = fresh
        self._cache = cache if cache is not None and cache.hold_writes(self) else None

    def restore(self, max_position: int | None = None) -> Restored:
        return Restored(caches=self.fresh())

    def offer_repeat(self) -> bool:
        return False

    def decline_repeat(self) -> None:
        pass

    def plan_position(self, limit: int) -> int:
        return 0

    def restore_cold(self) -> Restored:
        return self.restore()

    def log(self, text: str) -> None:
        pass

    def chunk(
        self,
        caches: list[Any],
        start: int,
        end: int,
        first_logprobs: Any = None,
        checkpoint: bool = True,
    ) -> list[mx.array]:
        return []

    def first_token(self, caches: list[Any]) -> None:
        self.close()

    def cancel(self, caches: list[Any], position: int) -> int:
        return 0

    def finish(
        self, caches: list[Any], sequence: Sequence[int], first_logprobs: Any, end_logprobs=None
    ) -> None:
        pass

    def discard(self) -> None:
        self.close()

    def close(self) -> None:
        if self._cache is not None:
            self._cache, cache = None, self._cache
            cache.release_writes(self)
