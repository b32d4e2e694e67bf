"""Sampling for one request: its sampler, logits processors and stop strings, from its
:class:`~tierchat.core.sampling_params.SamplingParams` (docs/DESIGN.md §2 "Sampling").

One home: the engine (and a batched scheduler) calls :func:`make_request_sampler` once per
request. The sampler and the processors are mlx-lm's (``make_sampler``,
``make_logits_processors``: temperature, top-p, top-k, min-p; repetition, presence and
frequency penalties); this module adds only what a prefix cache needs around them:

- **Context.** mlx-lm's processors read the token history ``generate_step`` passes them,
  which starts at the tokens it was given. Our prompts are prefilled apart (and restored
  from the cache), so :class:`ContextProcessors` prepends the prompt's last tokens: a
  penalty sees the same window as in a run that fed the whole prompt to
  ``generate_step``.
- **Raw logprobs.** A penalty is not shift-invariant (mlx-lm's repetition penalty divides a
  positive logit and multiplies a negative one), so it cannot be applied to log-probs kept
  from an earlier request. A request with processors therefore never starts from kept
  logprobs (:attr:`RequestSampling.needs_logits`), and what the cache keeps is always the
  model's own log-probs, before any processor.
- **Stop strings** (:class:`~tierchat.core.stop_strings.StopStrings`): text is held back while it could still become a
  stop string, so a streamed reply never shows part of one. It is the one stop-string
  matcher: the chat's requests and serve's carry their ``stop`` here.
- **Seeds while batched** (:class:`SeededSampler`): a seeded request draws from its own key
  stream, the one ``mx.random.seed(seed)`` gives a request alone, whatever else samples
  beside it on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from secrets import randbits
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from ..api import GenerateRequest
from ..stop_strings import StopStrings

__all__ = [
    "RequestSampling",
    "SeededSampler",
    "StopStrings",
    "keep_last_logits",
    "make_request_sampler",
]

Processor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class RequestSampling:
    """What :func:`make_request_sampler` builds for one request.

    ``sampler``: log-probs ``(1, vocab)`` -> token ``(1,)``. ``processors``: mlx-lm
    logits processors, ``(tokens (T,), logits (1, vocab)) -> logits``, without context
    (see :meth:`with_context`). ``stops``: the request's stop strings."""

    sampler: Callable[[mx.array], mx.array]
    processors: list[Processor] = field(default_factory=list)
    stops: tuple[str, ...] = ()
    context_size: int = 20  # tokens a penalty looks back over (SamplingParams)

    @property
    def needs_logits(self) -> bool:
        """The first token must come from the model's logits with the processors applied,
        not from log-probs kept by the cache."""
        return bool(self.processors)

    def with_context(self, context: Sequence[int]) -> list[Processor]:
        """The processors reading ``context`` (token ids before the ones
        ``generate_step`` is given) ahead of its own history; [] without processors."""
        if not self.processors:
            return []
        return [ContextProcessors(self.processors, context[-self.context_size :])]

    def first_logprobs(self, logits: mx.array, context: Sequence[int]) -> mx.array:
        """Log-probs ``(vocab,)`` to sample the first token from, given the model's logits
        ``(1, vocab)`` after the prompt ``context``: the processors applied, then
        normalized, as ``generate_step`` does."""
        for p in self.with_context(context):
            logits = p(mx.array([], dtype=mx.uint32), logits)
        return (logits - mx.logsumexp(logits, keepdims=True)).squeeze(0)


class ContextProcessors:
    """mlx-lm processors applied in order, each seeing ``context`` + the tokens passed."""

    def __init__(self, processors: Sequence[Processor], context: Sequence[int]) -> None:
        self.processors = list(processors)
        self.context = mx.array(list(context), dtype=mx.uint32)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        history = mx.concatenate([self.context, tokens.astype(mx.uint32)])
        for p in self.processors:
            logits = p(history, logits)
        return logits


def make_request_sampler(req: GenerateRequest) -> RequestSampling:
    """The sampler, processors and stop strings of ``req.sampling`` (greedy at temperature
    0; top-p 1, top-k 0, min-p 0 and penalties 1/0 are off). The values were checked when
    the :class:`~tierchat.core.sampling_params.SamplingParams` was made."""
    params = req.sampling
    sampler = make_sampler(
        temp=params.temperature,
        top_p=params.top_p if params.top_p < 1.0 else 0.0,
        min_p=params.min_p,
        top_k=params.top_k,
    )
    window = params.repetition_context_size
    processors = make_logits_processors(
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=window,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=window,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=window,
    )
    return RequestSampling(sampler, processors, params.stop, window)


class SeededSampler:
    """``sampler`` drawing from its own PRNG key stream, started at ``mx.random.key(seed)``:
    call by call, the draws of ``sampler`` after ``mx.random.seed(seed)`` on an otherwise
    idle thread, whatever other samplers draw in between (docs/DESIGN.md §20).

    MLX keeps one global key per thread; mlx-lm's samplers draw from it (one split per
    call: ``categorical_sampling``). Python can set that key only through
    ``mx.random.seed(int)``, and a key ``[hi, lo]`` (uint32) is the key of the seed
    ``hi << 32 | lo``; so each call seeds the global key with this stream's key, samples,
    and steps the stream by the split the sampler made, computed here on the CPU from
    known values (reading the global key back would wait for the sample). The global key
    is then reseeded from the OS's entropy, so unseeded requests never draw this stream's
    numbers. Engine thread only; ``seed`` in ``0 .. 2**64 - 1``."""

    def __init__(self, sampler: Callable[[mx.array], mx.array], seed: int) -> None:
        self.sampler = sampler
        self.seed = seed  # the key of the next call, as a 64-bit seed

    def __call__(self, logprobs: mx.array) -> mx.array:
        mx.random.seed(self.seed)
        token = self.sampler(logprobs)
        key = mx.random.split(mx.random.key(self.seed), stream=mx.cpu)[0]
        hi, lo = key.tolist()
        self.seed = (hi << 32) | lo
        mx.random.seed(randbits(64))
        return token


def keep_last_logits() -> tuple[Processor, Callable[[], Any]]:
    """A pass-through processor that remembers the last logits it saw, and a getter for
    them ``(1, vocab)`` (None before a call). Put first in ``generate_step``'s
    processors, it sees the model's own logits of each decode step; after a reply, the
    last ones are those after its last token (``generate_step`` computes one step
    ahead), which the cache keeps for a continue."""
    box: list[Any] = [None]

    def processor(_tokens: mx.array, logits: mx.array) -> mx.array:
        box[0] = logits
        return logits

    return processor, lambda: box[0]
