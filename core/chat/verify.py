"""Verify a turn against cold: would this reply have been the same without the cache?

The turn's prompt is run again twice with no cache and once through the cache, each time
teacher-forced on the reply shown (``GenerateRequest.teacher_ids``: every decode step is
fed the reply's next token and its logprobs are kept). The cached run is compared with the
first cold run, and the two cold runs with each other: the device's own noise floor (on
a GPU two cold runs of one prompt may already differ; on the CPU in float32 they agree bit
for bit). Per comparison (:class:`Agreement`): how many reply positions have the same
top-1 token, the first position whose logprob vectors differ at all, and the largest
absolute difference of the reply token's logprob over the positions (docs/DESIGN.md §18;
over the whole vocabulary the far tail dominates: on a GPU in bf16 one step of a logprob
near -20 is 0.125).

:func:`verify_turn` runs the three requests on an engine; :func:`verify_reply` verifies a
stored reply and keeps the report in the reply's ``meta["verify"]``
(:meth:`~tierchat.core.chat.store.ConversationStore.update_meta`). Both block until the
runs are done: call them off the UI thread. The runs are measurements, not turns
(``GenerateRequest.measure``): the hit rate, the tiers' counters, the stored entries, the
resident cache and the stats' last turn stay as they were. Progress goes to an
``on_progress(done, total)`` callback; a ``cancel`` event stops the run in flight at its
next engine step (:class:`VerifyCancelled`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..api import Failed, Finished, GenerateRequest, PrefillProgress, TokenBatch
from ..sampling_params import SamplingParams
from ..units import fmt_count


class VerifyError(Exception):
    """A turn cannot be verified (no reply, a failed run); the message says why."""


class VerifyCancelled(VerifyError):
    """The verify was stopped (its ``cancel`` event set) before its report."""


@dataclass(frozen=True)
class Agreement:
    """Two teacher-forced runs over the same reply of ``positions`` tokens: positions whose
    top-1 token agrees, the first position whose logprob vectors differ at all (None: bit
    for bit the same) and the largest ``|Δ logprob|`` of the reply's tokens."""

    positions: int
    top1_agree: int
    first_diff: int | None
    max_dlogprob: float

    @property
    def bitwise(self) -> bool:
        return self.first_diff is None

    def describe(self) -> str:
        """``"top-1 24/24 · bitwise"`` or ``"top-1 23/24 · first diff 5 · max |Δlp| 3.1e-02"``."""
        head = f"top-1 {self.top1_agree}/{self.positions}"
        if self.bitwise:
            return f"{head} · bitwise"
        return f"{head} · first diff {self.first_diff} · max |Δlp| {self.max_dlogprob:.1e}"


def agreement(a: list[np.ndarray], b: list[np.ndarray], tokens=None) -> Agreement:
    """Compare two runs' logprob vectors, position by position (shape ``(vocab,)`` each);
    ``tokens``: the reply's token at each position, whose logprobs are compared (None:
    every token's)."""
    n = min(len(a), len(b))
    agree, first, worst = 0, None, 0.0
    for i in range(n):
        x, y = np.asarray(a[i], np.float32), np.asarray(b[i], np.float32)
        agree += int(np.argmax(x) == np.argmax(y))
        if first is None and not np.array_equal(x, y):
            first = i
        if tokens is not None and i < len(tokens):
            x, y = x[int(tokens[i])], y[int(tokens[i])]
        worst = max(worst, float(np.max(np.abs(x - y))))
    if len(a) != len(b) and first is None:
        first = n
    return Agreement(n, agree, first, worst)


@dataclass(frozen=True)
class VerifyReport:
    """A turn verified: ``cached`` (through the cache vs cold), ``floor`` (cold vs cold),
    the prompt's length and the tokens the cached run restored, and the model."""

    cached: Agreement
    floor: Agreement
    prompt_tokens: int
    cached_tokens: int
    model: str = ""

    def describe(self) -> str:
        """One line for the message's row and the events."""
        return (
            f"verify vs cold: {self.cached.describe()} "
            f"({fmt_count(self.cached_tokens)}/{fmt_count(self.prompt_tokens)} cached) · "
            f"floor: {self.floor.describe()}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VerifyReport:
        return cls(
            Agreement(**d["cached"]),
            Agreement(**d["floor"]),
            int(d["prompt_tokens"]),
            int(d["cached_tokens"]),
            str(d.get("model", "")),
        )


Progress = Callable[[int, int], None]

CANCEL_POLL_S = 0.1
"""How often a waiting verify looks at its ``cancel`` event while its run emits nothing
(queued behind other requests, or held): a stop takes effect within this, or at the
run's next engine step."""


class _Runs:
    """The three runs of one verify and their progress: ``done`` of ``total`` token
    positions (each run: the prompt, prefilled or restored, then the reply's tokens)."""

    def __init__(self, prompt, reply, on_progress: Progress | None, cancel) -> None:
        self.n, self.r = len(prompt), len(reply)
        self.total = 3 * (self.n + self.r)
        self.base = 0  # positions of the runs already done
        self.on_progress = on_progress
        self.cancel = cancel

    def tell(self, done: int) -> None:
        if self.on_progress is not None:
            self.on_progress(self.base + done, self.total)

    def stopped(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


def _forced(engine: Any, prompt, reply, boundaries, use_cache: bool, timeout: float, runs: _Runs):
    """One teacher-forced run; ``timeout``: the longest wait for its next event (s)."""
    what = "cached" if use_cache else "cold"
    if runs.stopped():
        raise VerifyCancelled("verify stopped")
    req = GenerateRequest(
        prompt_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=len(reply)),
        boundaries=tuple(boundaries),
        use_cache=use_cache,
        teacher_ids=tuple(reply),
        measure=True,
    )
    events: queue.Queue = queue.Queue()
    box: list = []  # the handle, once submit returned (the engine may emit before)

    def on_event(event) -> None:  # the engine thread: a stop takes effect at its next step
        events.put(event)
        if box and runs.stopped():
            box[0].cancel()

    handle = engine.submit(req, on_event)
    box.append(handle)
    if runs.stopped():
        handle.cancel()
    decoded = 0
    last = time.monotonic()
    while True:
        try:  # in slices: a stop reaches a run that emits nothing (queued, or held)
            event = events.get(timeout=min(timeout, CANCEL_POLL_S))
        except queue.Empty:
            if runs.stopped():
                handle.cancel()
            elif time.monotonic() - last >= timeout:
                handle.cancel()
                raise VerifyError(f"the {what} run did not go on for {timeout:.0f} s") from None
            continue
        last = time.monotonic()
        if isinstance(event, PrefillProgress):
            runs.tell(runs.n - event.total + event.done)
        elif isinstance(event, TokenBatch) and event.token_ids:
            decoded += len(event.token_ids)
            runs.tell(runs.n + decoded)
        elif isinstance(event, (Finished, Failed)):
            break
    stopped = isinstance(event, Failed) and event.kind == "cancelled"
    stopped |= isinstance(event, Finished) and event.metrics.finish_reason == "cancelled"
    if stopped or runs.stopped():
        raise VerifyCancelled("verify stopped")
    if isinstance(event, Failed):
        raise VerifyError(f"the {what} run failed: {event.message}")
    runs.base += runs.n + runs.r
    runs.tell(0)
    return event, list(handle.trace.logprobs)


def verify_turn(
    engine: Any,
    prompt_ids,
    reply_ids,
    boundaries=(),
    timeout: float = 600.0,
    on_progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> VerifyReport:
    """Run ``prompt_ids`` teacher-forced on ``reply_ids`` through the cache and twice
    cold on ``engine`` (one request after the other) and compare (module doc).

    The runs are measurements (``GenerateRequest.measure``): no chat counter, no entry,
    no last turn moves. ``on_progress(done, total)``: token positions of the three runs
    (``total = 3 * (len(prompt_ids) + len(reply_ids))``), called on the caller's thread at
    each prefill piece and decode step. ``cancel``: set it to stop; the run in flight ends
    at its next engine step. ``timeout``: the longest wait for a run's next event (s).

    Raises:
        VerifyCancelled: ``cancel`` was set.
        VerifyError: an empty reply or prompt, or a run that failed or stalled.
    """
    if not prompt_ids or not reply_ids:
        raise VerifyError("nothing to verify: an empty prompt or reply")
    runs = _Runs(prompt_ids, reply_ids, on_progress, cancel)
    args = (engine, prompt_ids, reply_ids, boundaries)
    hot, lp_hot = _forced(*args, True, timeout, runs)
    _, lp_cold = _forced(*args, False, timeout, runs)
    _, lp_cold2 = _forced(*args, False, timeout, runs)
    report = VerifyReport(
        cached=agreement(lp_hot, lp_cold, reply_ids),
        floor=agreement(lp_cold2, lp_cold, reply_ids),
        prompt_tokens=len(prompt_ids),
        cached_tokens=hot.metrics.cached_tokens,
        model=engine.model_name,
    )
    note = getattr(engine, "note", None)  # the cache events (a fake engine may have none)
    if note is not None:
        note(report.describe())
    return report


def verify_reply(
    session: Any,
    node_id: int,
    timeout: float = 600.0,
    on_progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> VerifyReport:
    """Verify the stored assistant reply ``node_id`` of ``session``'s store: its prompt
    (the path to its user message, as the session builds it now) and its generated ids
    (or its text tokenized, for a reply with none or of another model). The report is
    stored in the reply's ``meta["verify"]``; a stopped verify stores nothing.
    ``on_progress``, ``cancel``, ``timeout``: as :func:`verify_turn`.

    Raises:
        VerifyCancelled: ``cancel`` was set.
        VerifyError: not an assistant reply, or a run failed.
    """
    store = session.store
    node = store.get_node(node_id)
    if node.role != "assistant" or node.parent_id is None:
        raise VerifyError("only a model's reply can be verified against cold")
    path = store.path_to(node.parent_id)
    prompt = session.build_prompt(path, session.settings(node.conversation_id))
    ids = node.token_ids
    if not ids or (node.meta or {}).get("model", session.engine.model_name) != (
        session.engine.model_name
    ):
        ids = tuple(session.engine.tokenizer.encode(node.content, add_special_tokens=False))
    report = verify_turn(
        session.engine, prompt.token_ids, ids, prompt.boundaries, timeout, on_progress, cancel
    )
    store.update_meta(node_id, "verify", report.to_dict())
    return report
