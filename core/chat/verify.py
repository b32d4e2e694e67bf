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
runs are done: call them off the UI thread.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..api import Failed, Finished, GenerateRequest
from ..sampling_params import SamplingParams
from ..units import fmt_count


class VerifyError(Exception):
    """A turn cannot be verified (no reply, a failed run); the message says why."""


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


def _forced(engine: Any, prompt, reply, boundaries, use_cache: bool, timeout: float):
    req = GenerateRequest(
        prompt_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=len(reply)),
        boundaries=tuple(boundaries),
        use_cache=use_cache,
        teacher_ids=tuple(reply),
    )
    handle = engine.submit(req)
    event = handle.wait(timeout)
    if isinstance(event, Failed):
        raise VerifyError(f"the {'cached' if use_cache else 'cold'} run failed: {event.message}")
    if not isinstance(event, Finished):
        raise VerifyError(f"the {'cached' if use_cache else 'cold'} run did not finish in time")
    return event, list(handle.logprobs)


def verify_turn(
    engine: Any, prompt_ids, reply_ids, boundaries=(), timeout: float = 600.0
) -> VerifyReport:
    """Run ``prompt_ids`` teacher-forced on ``reply_ids`` through the cache and twice
    cold on ``engine`` (one request after the other) and compare (module doc).

    Raises:
        VerifyError: an empty reply or prompt, or a run that failed or timed out.
    """
    if not prompt_ids or not reply_ids:
        raise VerifyError("nothing to verify: an empty prompt or reply")
    hot, lp_hot = _forced(engine, prompt_ids, reply_ids, boundaries, True, timeout)
    _, lp_cold = _forced(engine, prompt_ids, reply_ids, boundaries, False, timeout)
    _, lp_cold2 = _forced(engine, prompt_ids, reply_ids, boundaries, False, timeout)
    report = VerifyReport(
        cached=agreement(lp_hot, lp_cold, reply_ids),
        floor=agreement(lp_cold2, lp_cold, reply_ids),
        prompt_tokens=len(prompt_ids),
        cached_tokens=hot.metrics.cached_tokens,
        model=getattr(engine, "model_name", ""),
    )
    note = getattr(engine, "note", None)  # the cache events (a fake engine may have none)
    if note is not None:
        note(report.describe())
    return report


def verify_reply(session: Any, node_id: int, timeout: float = 600.0) -> VerifyReport:
    """Verify the stored assistant reply ``node_id`` of ``session``'s store: its prompt
    (the path to its user message, as the session builds it now) and its generated ids
    (or its text tokenized, for a reply with none or of another model). The report is
    stored in the reply's ``meta["verify"]``.

    Raises:
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
    report = verify_turn(session.engine, prompt.token_ids, ids, prompt.boundaries, timeout)
    store.update_meta(node_id, "verify", report.to_dict())
    return report
