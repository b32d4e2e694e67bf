"""mlx-lm's prompt cache as ``mlx_lm.server`` 0.32.2 runs it, for the in-process benches
(``tierchat bench``, ``tierchat bench --workload``; docs/DESIGN.md §17).

``mlx_lm/server.py`` serves a request on its batched path when the model is batchable
(every cache of ``make_prompt_cache`` has ``merge``, no draft model) and the request has
no ``seed`` and the server no ``--kv-bits`` (``ResponseGenerator._is_batchable``): the
default for every model here. That path, which :class:`LRUBaseline` follows:

1. the prompt is split into segments (``ResponseGenerator._tokenize``; :func:`segments`):
   for a chat request whose last message is the user's, the system segment (up to the
   first token where the chat template of the system messages and an empty user message
   differs from the prompt), the user segment (the rest, up to a thinking tail when the
   tokenizer has thinking tokens), the thinking tail; any other request is one segment;
2. ``LRUPromptCache.fetch_nearest_cache`` (exact, a longer trimmable entry cut back, or
   the longest shorter one), and the segments lose the tokens it covers;
3. ``BatchGenerator.insert_segments`` (which splits the last prompt token off as a
   segment of its own) and ``next()`` until the request finishes; at the end of each
   segment but the last the cache is extracted and inserted with its segment's type
   (``system``, ``user``); when the request finishes, the cache of prompt + generated
   tokens (the last one, an EOS token included, already through the model) is inserted
   as ``assistant``. ``insert_cache`` of a trimmable cache drops the entries that are its
   prefixes; the LRU holds 10 entries (``--prompt-cache-size``) and evicts by type.

A model that is not batchable is served as ``ResponseGenerator._serve_single`` does:
``fetch_nearest_cache``, ``stream_generate``'s ``generate_step`` over the rest
(``prefill_step_size`` 2048), ``insert_cache`` of prompt + generated tokens.

Everything runs on the engine thread (:meth:`Engine.call
<tierchat.core.engine.engine.Engine.call>`) with the engine's model, never the engine's cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from tierchat.cli.common import CLIError

PREFILL_STEP_SIZE = 2048  # mlx_lm.server's --prefill-step-size default
PROMPT_CACHE_SIZE = 10  # mlx_lm.server's --prompt-cache-size default
DECODE_CONCURRENCY = 32  # mlx_lm.server's --decode-concurrency default
PROMPT_CONCURRENCY = 8  # mlx_lm.server's --prompt-concurrency default
THINK_TAIL = 11  # tokens from the prompt's end where a thinking tail may start

SegmentType = Literal["system", "user", "assistant"]


class Segment(NamedTuple):
    """A piece of the prompt the server prefills up to before going on: its type (the
    LRU's ``cache_type`` of the cache saved at its end) and its token ids."""

    kind: SegmentType
    tokens: list[int]


def _template_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, tools=None, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def segments(tokenizer: Any, messages: Sequence[dict] | None, prompt: list[int]) -> list[Segment]:
    """``prompt`` split as ``mlx_lm.server`` splits a request (rule 1 of the module doc).
    ``messages`` are the chat's role/content dicts (other keys ignored); None for a plain
    completion, which is one segment."""
    whole = [Segment("assistant", list(prompt))]
    if not messages or messages[-1]["role"] != "user":
        return whole
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    n_system = next((i for i, m in enumerate(chat) if m["role"] != "system"), len(chat))
    out: list[Segment] = []
    sys_end = 0
    if n_system:
        ids = _template_ids(tokenizer, chat[:n_system] + [{"role": "user", "content": ""}])
        # the first position where the two differ (none: no system segment)
        pairs = enumerate(zip(ids, prompt, strict=False))
        sys_end = next((i for i, (a, b) in pairs if a != b), 0)
        if 0 < sys_end < len(prompt):
            out.append(Segment("system", list(prompt[:sys_end])))
    tail = len(prompt)
    if getattr(tokenizer, "has_thinking", False):
        start = tokenizer.rfind_think_start(prompt, start=tail - THINK_TAIL)
        if start >= 0:
            tail = start
    if sys_end < tail:
        out.append(Segment("user", list(prompt[sys_end:tail])))
    if tail < len(prompt):
        out.append(Segment("assistant", list(prompt[tail:])))
    return out or whole


def drop_cached(parts: list[Segment], cached: int) -> list[Segment]:
    """``parts`` without their first ``cached`` tokens (rule 2): whole segments covered
    are dropped with their type, a segment covered in part keeps its rest."""
    out = list(parts)
    while cached > 0 and out:
        first = out[0]
        if cached >= len(first.tokens):
            cached -= len(first.tokens)
            out.pop(0)
        else:
            out[0] = Segment(first.kind, first.tokens[cached:])
            cached = 0
    return out


def state_nbytes(caches: list[Any]) -> int:
    """Bytes of the arrays in ``caches``' states."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    total = 0
    for c in caches:
        for _, a in tree_flatten(c.state):
            if isinstance(a, mx.array):
                total += a.nbytes
    return total


class LRURequest(NamedTuple):
    """One mlx-lm request: ``counts`` (prompt, cached, prefilled tokens and ``ttft_s``),
    ``restore`` (``(restore_s, restore_bytes)``) and the generated token ids."""

    counts: dict
    restore: tuple[float, int]
    tokens: list[int]


class LRUBaseline:
    """``mlx_lm.server``'s default serving path (module doc) on the engine thread with the
    engine's model: its own ``LRUPromptCache`` and ``BatchGenerator``, never the engine's
    cache. ``batched`` says which path the server would take for this model."""

    def __init__(self, engine: Any, key: str) -> None:
        from mlx_lm.generate import make_stop_sequences
        from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
        from mlx_lm.sample_utils import make_sampler

        self.engine, self.key = engine, key
        self.lru = LRUPromptCache(max_size=PROMPT_CACHE_SIZE)
        self.sampler = make_sampler(temp=0.0)
        self.stops = make_stop_sequences(engine.tokenizer)
        model = engine.loaded.model
        self.batched = all(hasattr(c, "merge") for c in make_prompt_cache(model))
        self._batch = None  # the BatchGenerator, made on the engine thread at first use

    def run(self, prompt: list[int]) -> tuple[dict, tuple[float, int]]:
        """One completion request of one generated token: ``(counts, (restore_s,
        restore_bytes))``, restore being ``fetch_nearest_cache`` (deep copy + trim) plus an
        ``mx.eval`` of the copied state."""
        got = self.generate(prompt, max_tokens=1)
        return got.counts, got.restore

    def generate(
        self, prompt: list[int], max_tokens: int, messages: Sequence[dict] | None = None
    ) -> LRURequest:
        """One request of up to ``max_tokens`` greedy tokens for ``prompt`` (the chat's
        ``messages`` give the segments; None: a plain completion), as the server runs it;
        the generated ids end with the EOS token when it stopped on one."""
        if self.batched:
            parts = segments(self.engine.tokenizer, messages, prompt)
            return self.engine.call(lambda: self._generate_batched(prompt, max_tokens, parts))
        return self.engine.call(lambda: self._generate_single(prompt, max_tokens))

    def clear(self) -> None:
        self.engine.call(lambda: self.lru.trim_to(n_sequences=0))

    def _fetch(self, prompt: list[int]) -> tuple[Any, int, tuple[float, int], float]:
        """``fetch_nearest_cache``: (cache or None, cached tokens, restore, t0)."""
        import mlx.core as mx

        t0 = time.perf_counter()
        cache, rest = self.lru.fetch_nearest_cache(self.key, prompt)
        if cache is None:
            return None, 0, (0.0, 0), t0
        mx.eval([c.state for c in cache])
        return cache, len(prompt) - len(rest), (time.perf_counter() - t0, state_nbytes(cache)), t0

    @staticmethod
    def _counts(prompt: list[int], cached: int, ttft: float) -> dict:
        return {
            "prompt_tokens": len(prompt),
            "cached_tokens": cached,
            "prefill_tokens": len(prompt) - cached,
            "ttft_s": ttft,
        }

    def _generate_batched(self, prompt: list[int], max_tokens: int, parts: list[Segment]):
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        if self._batch is None:
            self._batch = BatchGenerator(
                self.engine.loaded.model,
                completion_batch_size=DECODE_CONCURRENCY,
                prefill_batch_size=PROMPT_CONCURRENCY,
                prefill_step_size=PREFILL_STEP_SIZE,
                stream=mx.default_stream(mx.default_device()),
            )
        cache, cached, restore, t0 = self._fetch(prompt)
        rest = drop_cached(parts, cached)
        if not rest:  # the server's insert_segments refuses an empty prompt
            raise CLIError("mlx-lm baseline: its cache holds the whole prompt (the server fails)")
        (uid,) = self._batch.insert_segments(
            segments=[[s.tokens for s in rest]],
            max_tokens=[max_tokens],
            caches=[cache],
            all_tokens=[list(prompt[:cached])],
            samplers=[self.sampler],
            stop_sequences=[self.stops],
        )
        del cache
        kinds = [s.kind for s in reversed(rest)]  # popped from the end, as the server does
        ttft, tokens = 0.0, []
        while True:
            prompt_steps, decoded = self._batch.next()
            ends = [
                r.uid for r in prompt_steps if r.end_of_segment and not r.end_of_prompt and kinds
            ]
            for saved, key in self._batch.extract_cache(ends).values():
                self.lru.insert_cache(self.key, key[:], saved, cache_type=kinds.pop())
            for r in decoded:
                if r.uid != uid:
                    continue
                if not tokens:
                    ttft = time.perf_counter() - t0
                tokens.append(int(r.token))
                if r.finish_reason is not None:
                    self.lru.insert_cache(
                        self.key, r.all_tokens[:], r.prompt_cache, cache_type="assistant"
                    )
                    return LRURequest(self._counts(prompt, cached, ttft), restore, tokens)
            if not prompt_steps and not decoded:
                raise CLIError("mlx-lm baseline: the BatchGenerator stopped before the reply")

    def _generate_single(self, prompt: list[int], max_tokens: int) -> LRURequest:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        model = self.engine.loaded.model
        eos = set(self.engine.tokenizer.eos_token_ids)
        cache, cached, restore, t0 = self._fetch(prompt)
        if cache is None:
            cache = make_prompt_cache(model)
        ttft, tokens = 0.0, []
        steps = generate_step(
            mx.array(prompt[cached:]),
            model,
            prompt_cache=cache,
            max_tokens=max_tokens,
            sampler=self.sampler,
            prefill_step_size=PREFILL_STEP_SIZE,
        )
        for token, _ in steps:
            if not tokens:
                ttft = time.perf_counter() - t0
            tokens.append(int(token))
            if token in eos:
                break
        steps.close()  # as stream_generate leaving its loop: no step past the last token
        self.lru.insert_cache(self.key, prompt + tokens, cache)
        return LRURequest(self._counts(prompt, cached, ttft), restore, tokens)
