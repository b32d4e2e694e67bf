"""The last prefill pieces of several requests in one forward (docs/DESIGN.md §20).

Requests that arrive together (clients of one server, a shared system prompt each) are
each restored by their own cache request and then need only their own rest of the prompt:
a user turn of a few hundred tokens. Run one after another, each rest is a forward of its
own that reads every weight again (24–56 ms a request on an 8B model on an H100); mlx-lm's
``BatchGenerator`` prefills the prompts that arrive together as one batch. Here the rests
of up to a chunk's worth of requests go through the model as one ``(B, L)`` forward:

- the restored caches merge into a ``BatchKVCache`` (``KVCache.merge``: left-padded to the
  longest, each row's RoPE offset its own length; quantized KV, ``kv_bits``, into a
  :class:`.quantized_batch.BatchQuantizedKVCache` the same way);
- each row's rest is right-padded to the longest rest; a padded position comes after the
  row's real tokens, so under the causal mask no real token sees one;
- rows whose last piece is folded (it ends at the prompt's end, :mod:`.forward`) get the
  logits at their own last real position, the others none;
- each row's cache comes back out as a plain (or quantized) KV cache of exactly its tokens (the merge's
  left padding and the rest's right padding sliced off), and its captures are taken on it,
  as :meth:`.prefill_steps.Prefill.piece` takes them.

- state layers (``ArraysCache``: Qwen3.5's GatedDeltaNet, Mamba) merge their states and
  are told each row's length (``prepare(lengths=...)``), so mlx-lm's recurrences and conv
  windows stop at the row's last real token, as its own batched prefill does.

Only requests whose every layer cache is a plain or quantized KV cache or a state cache
group (no sliding window or ``CacheList``), on schedules that promise float rounding only
(not ``bitwise``): the batched matmuls round as another shape does (with ``kv_bits`` such
a rounding can move a key across a quantization step, as on the folded schedule alone). Without state
layers a capture over the whole rest equals the captures of its chunks (no state
checkpoints to take at the chunk ends in between, :meth:`.cache.request.CacheRequest.chunk`);
with them, only a rest of one schedule piece groups.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, QuantizedKVCache

from ..api import PrefillProgress
from .decode_batch import cache_kinds, merge_caches, retype
from .forward import logprobs_of
from .prefill_steps import Prefill
from .quantized_batch import BatchQuantizedKVCache


def prefill_group(prefills: list[Prefill], width: int = 0) -> int:
    """Prefill the rest of every request of ``prefills`` (each ``groupable``) in one
    forward of shape ``(len(prefills), width)`` (at least the longest rest; the columns
    past a row's rest are padding, hidden by the causal mask); each ends finished, with its own
    caches, captures and (folded) first-token logprobs as if prefilled alone, up to float
    rounding. Returns the real tokens computed (padding not counted)."""
    runtime = prefills[0].runtime
    rows = [p.prompt[p.pos : p.ends[-1]] for p in prefills]
    lengths = [len(r) for r in rows]
    width = max(width, *lengths)
    tokens = mx.array([r + [0] * (width - len(r)) for r in rows])
    kv = (KVCache, QuantizedKVCache)
    sizes = [next((c.offset for c in p.caches if type(c) in kv), 0) for p in prefills]
    left = [max(sizes) - s for s in sizes]  # the merge's left padding of each row
    kinds = [cache_kinds(p.caches) for p in prefills]
    merged = merge_caches([p.caches for p in prefills])
    for c in merged:
        if isinstance(c, ArraysCache):  # state updates stop at each row's own length
            c.prepare(lengths=lengths)
    folded = [p.ends[-1] == p.n for p in prefills]
    logits = None
    if any(folded):
        logits = runtime.plan.last_logits(tokens, merged, mx.array([n - 1 for n in lengths]))
    else:
        runtime.model(tokens, cache=merged)
    computed: list[Any] = []
    for i, p in enumerate(prefills):
        pos, end = p.pos, p.ends[-1]
        p.caches = retype([_row(c, i, left[i], sizes[i] + lengths[i]) for c in merged], kinds[i])
        if folded[i]:
            row = logits[i : i + 1]
            p.first_logprobs = logprobs_of(row).squeeze(0)
            computed.append(p.first_logprobs)
            if p.sampling.needs_logits:
                p.first_sample = p.sampling.first_logprobs(row, p.prompt)
                computed.append(p.first_sample)
        computed += [c.state for c in p.caches]
        computed += p.capture(pos, end)
    mx.eval(computed)
    for p in prefills:
        p.pos = p.ends[-1]
        dt = time.perf_counter() - p.t0
        p.emit(PrefillProgress(p.done, p.total, p.done / dt if dt > 0 else 0.0))
    return sum(lengths)


def _row(cache: Any, i: int, left: int, size: int) -> Any:
    """Row ``i`` of ``cache`` as a request's own cache: of a ``BatchKVCache``, a
    ``KVCache`` of its ``size`` tokens, which start after ``left`` positions of padding
    (of a ``BatchQuantizedKVCache``, a ``QuantizedKVCache`` of them); of a merged state
    cache, its state (``extract``)."""
    if isinstance(cache, BatchQuantizedKVCache):
        out = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
        out.keys, out.values = tree_map(
            lambda x: mx.contiguous(x[i : i + 1, :, left : left + size]), (cache.keys, cache.values)
        )
        out.offset = size
        return out
    if not isinstance(cache, BatchKVCache):
        return cache.extract(i)
    out = KVCache()
    out.keys = mx.contiguous(cache.keys[i : i + 1, :, left : left + size])
    out.values = mx.contiguous(cache.values[i : i + 1, :, left : left + size])
    out.offset = size
    return out
