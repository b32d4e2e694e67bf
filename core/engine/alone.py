"""One request run to its end, alone: the path of a model across ranks (docs/DESIGN.md §19).

Every rank runs the same steps and agrees at the engine's rank seams (restore position,
cancels, sampled tokens), so across ranks the engine runs one request at a time, in the
schedule's chunks, decoding with mlx-lm's ``generate_step``. One process alone runs its
requests through the scheduler (:mod:`.scheduler`) instead.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, generation_stream

from ..api import (
    Failed,
    Finished,
    GenerateRequest,
    PrefillProgress,
    RequestHandle,
    TokenBatch,
    TurnMetrics,
)
from ..cache.request import CacheRequest, ColdRequest
from ..cache.schedule import chunk_ends
from .forward import logprobs_of
from .sampling import RequestSampling, StopStrings, keep_last_logits


def _from_kept(logprobs: mx.array, model, caches, max_tokens: int, sampler, logits_processors=None):
    """What ``generate_step`` yields for a prompt whose every token is in ``caches``, given
    the logprobs (shape ``(vocab,)``) its last token's forward gave before: the first
    token sampled from them, then ``generate_step`` from that token. The sampler is called
    in the same order as in ``generate_step``, so a seeded sampler draws the same."""
    y = sampler(logprobs[None])
    yield y.item(), logprobs
    if max_tokens > 1:
        yield from generate_step(
            y,
            model,
            prompt_cache=caches,
            max_tokens=max_tokens - 1,
            sampler=sampler,
            logits_processors=logits_processors,
        )


def generate_alone(
    engine: Any,
    req: GenerateRequest,
    handle: RequestHandle,
    points: list[int],
    fold_chunk: int,
    turn: CacheRequest | ColdRequest,
    sampling: RequestSampling,
) -> None:
    """Run ``req`` to its end on this thread: restore, prefill in the schedule's chunks
    (``points``; the folded last chunk when ``fold_chunk``), decode with ``generate_step``
    using ``sampling``, store the reply and emit its events (docs/DESIGN.md §19)."""
    t0 = time.perf_counter()
    mx.reset_peak_memory()
    prompt = list(req.prompt_ids)
    n = len(prompt)
    model = engine.loaded.model
    restored = engine.peers.restore(turn)
    restore_s = time.perf_counter() - t0
    caches = restored.caches
    start = restored.position

    def reuse(ttft: float) -> TurnMetrics:  # what the turn reused, known at its first token
        return TurnMetrics(
            prompt_tokens=n,
            cached_tokens=start,
            cached_by=dict(restored.cached_by),
            cached_kind=dict(restored.cached_kind),
            prefill_tokens=n - start,
            ttft_s=ttft,
            prefill_tps=(n - start) / ttft if ttft > 0 else 0.0,
        )

    ends = chunk_ends(start, points, fold_chunk)
    limit = engine._fold_limit
    if fold_chunk and limit is not None and ends and ends[-1] - max([start, *ends[:-1]]) > limit:
        ends[-1] = n - 1  # too long to fold here: the last token goes to decode
    handle.chunk_ends = tuple(ends)

    # prefill [start, n - 1) in the schedule's chunks, one eval per chunk (the last one
    # asynchronous, overlapping the first decode step's graph building), and the last
    # prompt token through the first decode step; on the folded schedule the last
    # chunk ends at n and gives the first token's logprobs itself (forward.py).
    # The request object captures window slices and state snapshots per chunk,
    # before the next chunk moves them
    total = n - start
    pos = start
    if ends:  # the prefill starts: its first chunk may take long (a CPU, a long prompt)
        handle.emit(PrefillProgress(0, total, 0.0))
    first_logprobs = restored.first_logprobs if start == n else None
    first_sample = None  # the folded chunk's logprobs with the processors applied
    for end in ends:
        engine._drain_control()
        if engine.peers.cancelled(handle):
            kept = turn.cancel(caches, pos)
            why = f"cancelled during prefill; kept {kept} of {n} tokens"
            handle.emit(Failed(why, kind="cancelled", kept_tokens=kept))
            return
        tokens_in = mx.array(prompt[pos:end])[None]
        computed = []
        if end == n:  # folded: this chunk gives the first token's logits
            logits = engine._last_logits(tokens_in, caches)
            first_logprobs = logprobs_of(logits).squeeze(0)  # kept: pre-processor
            computed.append(first_logprobs)
            if sampling.needs_logits:
                first_sample = sampling.first_logprobs(logits.reshape(1, -1), prompt)
                computed.append(first_sample)
        else:
            model(tokens_in, cache=caches)
        computed += [c.state for c in caches] + turn.chunk(caches, pos, end, first_logprobs)
        if end == ends[-1]:
            # the last chunk runs on the GPU while generate_step builds the first decode
            # step behind it on the same stream (its progress event is sent at launch)
            mx.async_eval(computed)
        else:
            mx.eval(computed)
        pos = end
        dt = time.perf_counter() - t0
        handle.emit(PrefillProgress(pos - start, total, (pos - start) / dt if dt > 0 else 0.0))

    # decode from the last prompt token
    if req.temperature > 0 and req.seed is not None:
        mx.random.seed(req.seed)
    sampler = sampling.sampler
    # continue hook: the first processor remembers each decode step's raw logits, so
    # the logprobs after the reply's last token are kept with the resident cache
    keep_end, end_logits = keep_last_logits()
    eos = engine.eos_token_ids
    record = engine.record_logprobs
    max_tokens = engine._cap_tokens(req.max_tokens, n)
    if req.teacher_ids:
        # generate_step samples one step ahead of what it yields: pad the last call
        forced = iter(req.teacher_ids)
        sampler = lambda logprobs: mx.array([next(forced, 0)])  # noqa: E731
        eos, record, max_tokens = set(), len(req.teacher_ids), len(req.teacher_ids)
    sampler, stop_flags = engine.peers.share_sampler(sampler, handle)
    detok = engine.loaded.tokenizer.detokenizer
    detok.reset()
    tokens: list[int] = []
    logprobs: list[np.ndarray] = []
    ttft = t_first = None
    reason = "length"
    if first_logprobs is not None:  # kept from before, or the folded last chunk's
        processors = [keep_end, *sampling.with_context(prompt)]
        steps = _from_kept(
            first_sample if first_sample is not None else first_logprobs,
            model,
            caches,
            max_tokens,
            sampler,
            processors,
        )
    else:
        processors = [keep_end, *sampling.with_context(prompt[:-1])]
        steps = generate_step(
            mx.array(prompt[n - 1 :]),
            model,
            prompt_cache=caches,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=processors,
        )
    stops = StopStrings(sampling.stops)
    shown = ""  # text sent so far (held back while it may begin a stop string)
    first_lp = None
    for tok, lp in steps:
        if ttft is None:
            first_lp = lp
            t_first = time.perf_counter()
            ttft = t_first - t0
            turn.first_token(caches)
            if pos < n:  # the last prompt token went through the first decode step
                handle.emit(PrefillProgress(total, total, total / ttft if ttft else 0.0))
            # what the turn reused and its TTFT are known now: the stats show them
            # while it decodes (the decode rate comes with the finished record below)
            engine._last = reuse(ttft)
        tokens.append(tok)
        if len(logprobs) < record:
            logprobs.append(np.array(lp.astype(mx.float32)))
        if tok in eos:
            reason = "stop"
            break
        detok.add_token(tok)
        if stops.stops:
            safe, hit = stops.feed(detok.text)
            handle.emit(TokenBatch((tok,), safe[len(shown) :]))
            shown = safe
            if hit:
                reason = "stop"
                break
        else:
            handle.emit(TokenBatch((tok,), detok.last_segment))
        engine._drain_control()
        if engine.peers.stopped(handle, stop_flags, len(tokens) - 1):
            reason = "cancelled"
            break
    if first_logprobs is not None and len(tokens) == 1:
        # generate_step computes one step ahead, so a cold run's cache also holds the
        # first token when the reply stops there: forward it here, as that step would
        for _ in generate_step(
            mx.array(tokens),
            model,
            prompt_cache=caches,
            max_tokens=0,
            sampler=sampler,
            logits_processors=[keep_end],
        ):
            pass
    # generate_step evaluates one step ahead: wait for that step, or the thread-local
    # stream still has work when the thread ends and the process aborts at exit
    mx.synchronize(generation_stream)
    detok.finalize()
    text = detok.text
    if stops.stops:
        text, _ = stops.feed(text) if reason == "stop" else (text, False)
        tail_text = text[len(shown) :]
    else:
        tail_text = detok.last_segment
    if tail_text:
        handle.emit(TokenBatch((), tail_text))
    t_end = time.perf_counter()
    # the cache holds prompt + every yielded token: store its new blocks and its end,
    # then keep it resident for the next request, with the logprobs after its last
    # token (the last decode step's forward) for a continue
    end = end_logits()
    end_lp = logprobs_of(end).reshape(-1) if end is not None and tokens else None
    if end_lp is not None:
        mx.eval(end_lp)
    turn.finish(caches, prompt + tokens, first_lp, end_lp)
    handle.logprobs = logprobs
    handle.restored_position = start
    ttft = ttft if ttft is not None else t_end - t0
    g = len(tokens)
    metrics = dataclasses.replace(
        reuse(ttft),
        generation_tokens=g,
        generation_tps=(g - 1) / (t_end - t_first) if g > 1 and t_end > t_first else 0.0,
        peak_memory_bytes=int(mx.get_peak_memory()),
        finish_reason=reason,
        restore_s=restore_s,
        restore_bytes=restored.nbytes,
        restore_choice=restored.choice.describe() if restored.choice else "",
        ssd_write_bytes=turn.ssd_write_bytes,
    )
    engine._last = metrics
    # before Finished: the caller's next stats() has every rank's figures
    engine.peers.gather_stats(engine.cache, engine.monitor.stats)
    handle.emit(Finished(tuple(tokens), text, metrics))
    engine._apply_memory_pressure()
