"""The running sequences' decode: one batched step for all of them (docs/DESIGN.md §20).

Built on the decode half of mlx-lm's continuous batching (``mlx_lm.generate``'s
``GenerationBatch``, what its ``BatchGenerator`` moves a sequence into once its prompt is
processed): tierchat prefills each request itself (restore, schedule chunks, captures), so
a sequence joins here with its filled cache and the token to feed next. Its caches merge
into the batch's (``KVCache`` -> :class:`.batch_kv.OneCopyBatchKVCache`, mlx-lm's
``BatchKVCache`` joining in one copy; ``RotatingKVCache`` ->
``BatchRotatingKVCache``, ``ArraysCache.merge``; ``QuantizedKVCache``, ``kv_bits``, ->
:class:`.quantized_batch.BatchQuantizedKVCache`), which left-pads shorter sequences; a
finished or removed sequence's cache comes back out as a plain per-request cache
(``extract``), so the prefix cache stores and keeps it as a request run alone.

A joining sequence's token goes through the model with the batch's next step, not in a
forward of its own (``GenerationBatch``'s constructor runs one: a pass of the weights per
join, which with eight clients arriving together was one extra step per client); the
sequences added between two steps merge into the batch at once (each merge copies the
batch's whole cache). One
sequence alone decodes on its own cache list, as mlx-lm's ``generate_step`` would (no
padding, no mask): a lone request's numbers are those of a request before batching. A
second mergeable sequence merges the first into a batch. Caches with no batch form
(none of the layer kinds the prefix cache supports, docs/DESIGN.md §5) would decode
alone, one step per sequence per batch step.

Everything here runs on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm.sample_utils import make_sampler

from .quantized_batch import merge_layer, merge_of

Sampler = Callable[[mx.array], mx.array]


def mergeable(caches: list[Any]) -> bool:
    """Whether every layer cache of ``caches`` can join a batch (has a batch form,
    :func:`.quantized_batch.merge_of`)."""

    def ok(c: Any) -> bool:
        sub = getattr(c, "caches", None)
        if sub is not None:  # CacheList
            return all(ok(x) for x in sub)
        return merge_of(type(c)) is not None  # (the batch class it merges into extracts)

    return all(ok(c) for c in caches)


def merge_caches(caches: list[list[Any]]) -> list[Any]:
    """One batch cache per layer of the per-sequence cache lists ``caches`` (each layer
    class's batch form, :func:`.quantized_batch.merge_layer`)."""
    return [merge_layer(list(layer)) for layer in zip(*caches, strict=True)]


def retype(caches: list[Any], kinds: list[Any]) -> list[Any]:
    """``extract`` builds the base class (``ArraysCache`` of a ``MambaCache``): give each
    layer cache back the class it joined with, which the prefix cache's adapters know."""
    for c, kind in zip(caches, kinds, strict=True):
        if isinstance(kind, tuple):  # CacheList: its members' classes
            retype(list(c.caches), list(kind))
        elif type(c) is not kind and isinstance(c, kind.__mro__[1:]):
            c.__class__ = kind
    return caches


def cache_kinds(caches: list[Any]) -> list[Any]:
    return [tuple(cache_kinds(list(c.caches))) if hasattr(c, "caches") else type(c) for c in caches]


class _Batch(GenerationBatch):
    """A ``GenerationBatch`` whose caches are either merged (batch caches, ``merged``) or
    one sequence's own list (``merged`` False: extracted as is).

    Built with ``joining`` True, its constructor computes nothing: the token it is given
    goes through the model with the batch's next step (``GenerationBatch`` would run a
    forward for the joining sequence alone, one extra pass of the weights per join), so
    that step's response for it repeats the token and :class:`DecodeBatch` drops it."""

    merged = False
    kinds: list[list[Any]]  # per sequence: the classes of its layer caches

    def __init__(self, *args: Any, joining: bool = False, **kwargs: Any) -> None:
        self._joining = joining
        super().__init__(*args, **kwargs)
        if joining:
            self._joining = False
            # the logprobs that step returns for the repeated token: never read
            self._next_logprobs = [mx.zeros((1,))] * len(self.uids)
            self._matchers = [_SkipFirst(m) for m in self._matchers]

    def _step(self):
        if self._joining:
            return [], []
        return super()._step()

    def extract_cache(self, idx: int) -> list[Any]:
        if self.merged:
            return retype(super().extract_cache(idx), self.kinds[idx])
        return list(self.prompt_cache)  # filter() clears the list it holds

    def filter(self, keep: list[int]) -> None:
        self.kinds = [self.kinds[i] for i in keep]
        super().filter(keep)

    def extend(self, batch: _Batch) -> None:
        self.kinds = self.kinds + batch.kinds
        super().extend(batch)


class _SkipFirst:
    """A stop-sequence matcher that ignores its first token (the joining token, already
    checked by the scheduler)."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self._first = True

    def advance(self, token: int) -> bool:
        if self._first:
            self._first = False
            return False
        return self._matcher.advance(token)


@dataclass(frozen=True)
class _Join:
    """A sequence added to a :class:`DecodeBatch` and not yet merged into it."""

    uid: int
    token: int
    caches: list[Any]
    context: list[int]
    max_tokens: int
    stop: list[list[int]]
    sampler: Sampler | None
    processors: list[Any] | None


@dataclass(frozen=True)
class Step:
    """One sequence's token from a decode step: ``token``, the ``logprobs`` it was sampled
    from (shape ``(vocab,)``), ``finish`` ("stop", "length" or None) and, when finished,
    its ``caches`` (the request's own cache list, holding every token fed so far)."""

    uid: int
    token: int
    logprobs: mx.array
    finish: str | None
    caches: list[Any] | None = None


class DecodeBatch:
    """The decoding sequences of one model: :meth:`add`, :meth:`step`, :meth:`remove`.

    ``share`` wraps every sampler (the batch's greedy one and each sequence's own): across
    ranks, so that the tokens are rank 0's on every rank (docs/DESIGN.md §19); alone, it
    returns the sampler itself."""

    def __init__(self, model: Any, share: Callable[[Sampler], Sampler] = lambda s: s) -> None:
        self.model = model
        self._share = share
        self._greedy = share(make_sampler(temp=0.0))
        self._main: _Batch | None = None  # merged, or one mergeable sequence alone
        self._alone: dict[int, _Batch] = {}  # sequences whose caches cannot merge
        self._unfed: dict[int, int] = {}  # joined, their token not yet through the model
        self._pending: list[_Join] = []  # added since the last step (merged at the next)
        self.peak = 0  # the most sequences that decoded in one step
        self.peak_merged = 0  # the most that decoded in one merged batch

    def __len__(self) -> int:
        main = len(self._main) if self._main is not None else 0
        return main + len(self._alone) + len(self._pending)

    def add(
        self,
        uid: int,
        token: int,
        caches: list[Any],
        context: list[int],
        max_tokens: int,
        stop: list[list[int]],
        sampler: Sampler | None = None,
        processors: list[Callable[[mx.array, mx.array], mx.array]] | None = None,
    ) -> None:
        """Start decoding sequence ``uid``: ``caches`` hold every token before ``token``,
        which is fed next (with the batch's next step); ``context``: the tokens in ``caches``
        (for logits processors); at most ``max_tokens`` (> 0) tokens come out, ending early
        at any of the ``stop`` sequences; ``sampler`` None: greedy (one batched argmax);
        ``processors``: mlx-lm logits processors ``(history, logits (1, vocab)) -> logits``,
        the history being ``context`` + the tokens fed since."""
        self._pending.append(
            _Join(uid, token, caches, list(context), max_tokens, stop, sampler, processors)
        )
        self._unfed[uid] = token

    def _batch_of(self, joins: list[_Join], caches: list[Any]) -> _Batch:
        """A joining batch of ``joins`` over ``caches`` (merged, or one sequence's own)."""
        batch = _Batch(
            self.model,
            [j.uid for j in joins],
            mx.array([j.token for j in joins], dtype=mx.uint32),
            caches,
            [j.context for j in joins],
            [self._share(j.sampler) if j.sampler is not None else None for j in joins],
            self._greedy,
            [tuple(j.processors or ()) for j in joins],
            [StopSequences(j.stop) for j in joins],
            [j.max_tokens + 1 for j in joins],  # + the repeated token of the first step
            joining=True,
        )
        batch.kinds = [cache_kinds(j.caches) for j in joins]
        return batch

    def _flush(self) -> None:
        """Move the sequences added since the last step into the batch: one merge for all
        of them (each join's merge copies the batch's whole cache, so joins of one step
        merge once), the ones whose caches cannot merge apart."""
        pending, self._pending = self._pending, []
        joins = []
        for j in pending:
            if mergeable(j.caches):
                joins.append(j)
            else:
                self._alone[j.uid] = self._batch_of([j], j.caches)
        if not joins:
            return
        main = self._main
        if (main is None or len(main) == 0) and len(joins) == 1:
            self._main = self._batch_of(joins, joins[0].caches)  # alone: its own caches
            return
        batch = self._batch_of(joins, merge_caches([j.caches for j in joins]))
        batch.merged = True
        if main is None or len(main) == 0:
            self._main = batch
        else:
            if not main.merged:
                main.prompt_cache = merge_caches([main.prompt_cache])
                main.merged = True
            main.extend(batch)
        self.peak_merged = max(self.peak_merged, len(self._main))

    def step(self) -> list[Step]:
        """One decode step of every sequence: each yields one token."""
        self._flush()
        self.peak = max(self.peak, len(self))
        out: list[Step] = []
        batches = ([self._main] if self._main is not None and len(self._main) else []) + list(
            self._alone.values()
        )
        for batch in batches:
            for r in batch.next():
                if self._unfed.pop(r.uid, None) is not None:
                    continue  # the joining token, fed with this step: no new token
                out.append(Step(r.uid, r.token, r.logprobs, r.finish_reason, r.prompt_cache))
        for uid in [u for u, b in self._alone.items() if len(b) == 0]:
            del self._alone[uid]
        if self._main is not None and len(self._main) == 0:
            self._main = None  # the next lone sequence decodes on its own caches again
        return out

    def remove(self, uid: int) -> list[Any]:
        """Take sequence ``uid`` out of the batch (a cancel): its caches, holding every
        token fed so far (the token sampled ahead is dropped).

        Raises:
            KeyError: ``uid`` is not decoding here.
        """
        pending = next((j for j in self._pending if j.uid == uid), None)
        batch = self._alone.pop(uid, None)
        if pending is not None:
            self._pending.remove(pending)
            caches = pending.caches
        elif batch is not None:
            caches = batch.extract_cache(0)
        else:
            main = self._main
            if main is None or uid not in main.uids:
                raise KeyError(uid)
            i = main.uids.index(uid)
            caches = main.extract_cache(i)
            main.filter([j for j in range(len(main.uids)) if j != i])
            if len(main) == 0:
                self._main = None
        token = self._unfed.pop(uid, None)
        if token is not None:  # removed before its first step: feed its token now
            self.model(mx.array([[token]], dtype=mx.uint32), cache=caches)
            mx.eval([c.state for c in caches])
        return caches
