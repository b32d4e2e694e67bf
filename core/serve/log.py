"""The server's request log and queue count. Pure Python: no MLX, no Textual.

The engine serves one request at a time from its queue; every caller (the HTTP server,
the console's chat pane) submits through one :class:`TrackedEngine`, which counts what is
queued and running and writes one :class:`RequestRecord` per request into a
:class:`RequestLog`. The console reads :meth:`RequestLog.snapshot` on its poll; the HTTP
server reads the same numbers for ``/v1/models`` and its own logging.

"Running" is a request the engine has emitted an event for; the engine emits nothing
when it picks a request up, so a request restoring its prefix still counts as waiting
until its first prefill chunk or token.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from ..api import (
    CacheStats,
    EngineLike,
    Event,
    EventCallback,
    Failed,
    Finished,
    GenerateRequest,
    ModelInfo,
    PrefillProgress,
    RequestHandle,
    Stopping,
    TokenBatch,
    TurnMetrics,
    WritesFlushed,
)
from ..text import log_safe

RequestStatus = Literal["waiting", "running", "stopping", "done", "failed", "cancelled"]
LIVE_STATUSES: tuple[str, ...] = ("waiting", "running", "stopping")  # not ended yet


@dataclass(frozen=True)
class RequestRecord:
    """One request as the log shows it. Times in seconds; ``ttft_s`` is the engine's
    (request start to first token), ``wait_s`` the time queued before that (what the
    client saw as TTFT is ``wait_s + ttft_s``)."""

    seq: int
    client: str
    endpoint: str
    submitted_at: float  # time.time()
    status: RequestStatus = "waiting"
    wait_s: float = 0.0
    error: str = ""
    # while it runs, what it is doing: "prefill 512/3000", "decoding", "stopping…"
    phase: str = ""
    # what the engine reported: the prompt length from the start, the rest when it ends
    metrics: TurnMetrics = field(default_factory=lambda: TurnMetrics(finish_reason=""))


@dataclass(frozen=True)
class LogSnapshot:
    """What the console shows: the newest records (oldest first), the queue and totals.
    ``version`` grows on every change, so a poller can skip unchanged snapshots."""

    version: int
    records: tuple[RequestRecord, ...]
    waiting: int
    running: int
    total: int
    failed: int
    url: str = ""


class RequestLog:
    """A bounded, thread-safe log of requests (the newest ``max_records``) plus the queue
    counts. Written from the engine thread and the server's threads, read from anywhere."""

    def __init__(self, max_records: int = 500, url: str = "") -> None:
        self.url = url
        self._records: deque[RequestRecord] = deque(maxlen=max_records)
        self._by_seq: dict[int, RequestRecord] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._version = 0
        self._total = 0
        self._failed = 0
        self._listeners: list[Callable[[RequestRecord], None]] = []

    def subscribe(self, listener: Callable[[RequestRecord], None]) -> None:
        """Call ``listener(record)`` (on the writer's thread) after each record changes."""
        self._listeners.append(listener)

    def open(self, client: str, endpoint: str) -> RequestRecord:
        """A new waiting record; ``client`` and ``endpoint`` are stored :func:`log_safe`."""
        with self._lock:
            record = RequestRecord(
                next(self._seq), log_safe(client), log_safe(endpoint), time.time()
            )
            if len(self._records) == self._records.maxlen:
                self._by_seq.pop(self._records[0].seq, None)
            self._records.append(record)
            self._by_seq[record.seq] = record
            self._total += 1
            self._version += 1
        self._notify(record)
        return record

    def update(
        self, seq: int, metrics_changes: dict | None = None, **changes
    ) -> RequestRecord | None:
        """Replace fields of record ``seq`` (an ``error`` stored :func:`log_safe`) and, with
        ``metrics_changes``, fields of its metrics; None when it already left the log."""
        if isinstance(changes.get("error"), str):
            changes["error"] = log_safe(changes["error"])
        with self._lock:
            old = self._by_seq.get(seq)
            if old is None:
                return None
            if metrics_changes:
                changes["metrics"] = replace(changes.get("metrics", old.metrics), **metrics_changes)
            new = replace(old, **changes)
            if new.status == "failed" and old.status != "failed":
                self._failed += 1
            self._by_seq[seq] = new
            # records are few and mostly the newest change: scan from the right
            for i in range(len(self._records) - 1, -1, -1):
                if self._records[i].seq == seq:
                    self._records[i] = new
                    break
            self._version += 1
        self._notify(new)
        return new

    def _notify(self, record: RequestRecord) -> None:
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # noqa: BLE001 -- a listener never breaks the engine thread
                pass

    def snapshot(self) -> LogSnapshot:
        with self._lock:
            records = tuple(self._records)
            version, total, failed = self._version, self._total, self._failed
        waiting = sum(r.status == "waiting" for r in records)
        running = sum(r.status in ("running", "stopping") for r in records)
        return LogSnapshot(version, records, waiting, running, total, failed, self.url)


class TrackedEngine:
    """An :class:`~tierchat.core.api.EngineLike` in front of the one engine: every submit is
    logged (one :class:`RequestRecord`, labelled with ``client`` and ``endpoint``) and
    counted while queued or running. Everything else is passed through, so the TUI's chat
    session and the HTTP server can share it."""

    def __init__(self, engine: EngineLike, log: RequestLog) -> None:
        self.engine = engine
        self.log = log

    # pass-through
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine.eos_token_ids

    def load_model(self, model: str, on_event: EventCallback | None = None) -> RequestHandle:
        return self.engine.load_model(model, on_event)

    def stats(self) -> CacheStats:
        return self.engine.stats()

    def clear(self, tier: str) -> None:
        self.engine.clear(tier)

    def close(self) -> None:
        self.engine.close()

    @property
    def info(self) -> ModelInfo | None:
        return self.engine.info

    @property
    def writes_queued(self) -> int:
        return self.engine.writes_queued

    def shutdown(self, timeout_s: float, *, close: bool = True) -> WritesFlushed:
        return self.engine.shutdown(timeout_s, close=close)

    def __getattr__(self, name: str):  # settings, record_logprobs, ... of the real engine
        return getattr(self.engine, name)

    @property
    def queue_depth(self) -> int:
        """Requests submitted and not finished (waiting + running)."""
        snap = self.log.snapshot()
        return snap.waiting + snap.running

    def submit(
        self,
        request: GenerateRequest,
        on_event: EventCallback | None = None,
        *,
        client: str = "chat",
        endpoint: str = "chat",
    ) -> RequestHandle:
        """As ``Engine.submit``; the request is logged as ``client``/``endpoint``."""
        record = self.log.open(client, endpoint)
        seq = record.seq
        t_submit = time.perf_counter()
        state = {"running": False, "first_token_at": 0.0}

        def watch(event: Event) -> None:
            if isinstance(event, Stopping):
                self.log.update(seq, status="stopping", phase="stopping…")
                state["stopping"] = True
            elif not state["running"] and not isinstance(event, Failed | Finished):
                state["running"] = True
                n = len(request.prompt_ids)
                self.log.update(seq, status="running", metrics_changes={"prompt_tokens": n})
            if isinstance(event, PrefillProgress) and not state.get("stopping"):
                self.log.update(seq, phase=f"prefill {event.done}/{event.total}")
            if isinstance(event, TokenBatch) and not state["first_token_at"]:
                state["first_token_at"] = time.perf_counter()
                if not state.get("stopping"):
                    self.log.update(seq, phase="decoding")
            if isinstance(event, Finished):
                m = event.metrics
                first = state["first_token_at"] or time.perf_counter()
                cancelled = m.finish_reason == "cancelled"
                self.log.update(
                    seq,
                    phase="",
                    status="cancelled" if cancelled else "done",
                    wait_s=max(0.0, first - t_submit - m.ttft_s),
                    metrics=m,
                )
            elif isinstance(event, Failed):
                status = "cancelled" if event.kind == "cancelled" else "failed"
                self.log.update(seq, status=status, error=event.message, phase="")
            if on_event is not None:
                on_event(event)

        try:
            handle = self.engine.submit(request, watch)
        except Exception as e:
            self.log.update(seq, status="failed", error=str(e) or type(e).__name__)
            raise
        handle.log_seq = seq  # type: ignore[attr-defined] -- for the caller's own updates
        return handle
