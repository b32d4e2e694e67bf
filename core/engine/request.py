"""One request in the engine, from arrival to its last event (docs/DESIGN.md §20).

A :class:`Request` holds the caller's :class:`~.api.GenerateRequest` (``params``), its
handle (None on a worker rank: the same steps run, nobody listens), its
:data:`~.api.RequestStatus`, its prefill (:class:`~.prefill_steps.Prefill`: the position,
the request's cache object, the caches) and, once it decodes, its :class:`Decoding`:
the tokens, the detokenizer and the stop strings. What the run leaves to inspect (the
chunk ends, the restored position, the log-probabilities kept) is its
:class:`~.api.RequestTrace`, returned in the :class:`~.api.Finished` event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from ..api import Event, GenerateRequest, RequestHandle, RequestStatus, RequestTrace, TokenBatch
from ..stop_strings import StopStrings
from .prefill_steps import Prefill


@dataclasses.dataclass(eq=False)
class Decoding:
    """A request's decode state: the ``tokens`` so far, the ``eos`` ids that end it, the
    detokenizer (``detok``, mlx-lm's streaming one) and the stop strings (``stops``; text
    that may begin one is held back: ``shown`` is what went out), ``end_logits`` (() -> the
    raw logits after the last token fed, (1, vocab), or None), the first ``record`` steps'
    log-probabilities kept (``logprobs``), and ``t_first`` / ``first_lp`` (the first
    token's time on the engine's clock and its log-probabilities)."""

    detok: Any
    stops: StopStrings
    eos: set[int]
    record: int
    end_logits: Callable[[], Any]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[np.ndarray] = dataclasses.field(default_factory=list)
    shown: str = ""
    t_first: float | None = None
    first_lp: Any = None

    def add(self, tok: int, lp: mx.array) -> tuple[TokenBatch | None, bool]:
        """Record ``tok`` (sampled from ``lp``, shape ``(vocab,)``): the event to send (None
        at an end-of-sequence token) and whether the reply ends here (an end-of-sequence
        token or a stop string)."""
        self.tokens.append(tok)
        if len(self.logprobs) < self.record:
            self.logprobs.append(np.array(lp.astype(mx.float32)))
        if tok in self.eos:
            return None, True
        self.detok.add_token(tok)
        if self.stops.stops:  # stop strings: hold back what may begin one
            safe, hit = self.stops.feed(self.detok.text)
            event = TokenBatch((tok,), safe[len(self.shown) :])
            self.shown = safe
            return event, hit
        return TokenBatch((tok,), self.detok.last_segment), False

    def close(self, reason: str) -> tuple[str, str]:
        """The reply ends for ``reason``: ``(text, tail)``, the whole reply's text (cut
        before a stop string it ends at) and the part not sent yet."""
        self.detok.finalize()
        text = self.detok.text
        if self.stops.stops:
            text = self.stops.feed(text)[0] if reason == "stop" else text
            return text, text[len(self.shown) :]
        return text, self.detok.last_segment


@dataclasses.dataclass(eq=False)
class Request:
    """One request the engine holds (docs/DESIGN.md §20): ``queued`` -> ``prefill`` ->
    ``decoding``, reported ``stopping`` from its cancel on."""

    uid: int
    params: GenerateRequest
    handle: RequestHandle | None = None
    status: RequestStatus = "queued"
    prefill: Prefill | None = None
    decoding: Decoding | None = None
    chunk_ends: tuple[int, ...] = ()  # the prefill's planned forwards (trace)
    cold: bool = False  # start again from no cache: a rank's restore landed short (§19)

    @property
    def cancelled(self) -> bool:
        return self.handle is not None and self.handle.cancelled

    @property
    def done(self) -> bool:
        return self.handle is None or self.handle.done

    def emit(self, event: Event) -> None:
        """Send ``event`` to the caller (none on a worker rank)."""
        if self.handle is not None:
            self.handle.emit(event)

    @property
    def shown_status(self) -> RequestStatus:
        """The status callers see: ``stopping`` once cancelled past the queue."""
        return "stopping" if self.cancelled and self.status != "queued" else self.status

    def trace(self) -> RequestTrace:
        """What this run leaves to inspect (:class:`~.api.RequestTrace`)."""
        p, d = self.prefill, self.decoding
        return RequestTrace(
            chunk_ends=self.chunk_ends,
            restored_position=p.start if p is not None else 0,
            logprobs=tuple(d.logprobs) if d is not None else (),
        )
