"""Types shared by the engine, the CLI and the TUI. Pure Python: no MLX, no Textual.

The engine runs every MLX operation on its own thread and talks to the rest of the program
only through these types: a :class:`GenerateRequest` goes in, events come out through a
callback and a :class:`RequestHandle`, and :class:`CacheStats` snapshots are read at will.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Literal, NamedTuple, Protocol

from .sampling_params import SamplingParams

Role = Literal["system", "user", "assistant"]
CacheTier = Literal["hot", "ssd", "tails", "all"]
CACHE_TIERS: tuple[str, ...] = ("hot", "ssd", "tails", "all")
# where cached tokens came from: the tier (RAM or disk) ...
CACHE_SOURCES: tuple[str, ...] = ("hot", "ssd")
# ... and what kind of entry held them: the resident cache of the last request, full
# blocks, MRU prompt tails, checkpoints (sequence ends and message boundaries)
CACHE_KINDS: tuple[str, ...] = ("resident", "block", "tail", "checkpoint")
FailureKind = Literal["error", "refused", "unsupported", "load", "cancelled"]


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: a full prompt as token ids, sampled as ``sampling`` says
    (:class:`~tierchat.core.sampling_params.SamplingParams`: greedy at its defaults).

    ``boundaries`` holds ``(end_offset, role)`` for each message of the prompt: the token
    offset just after the message's last token and the message's role. The cache tags
    blocks with the role they end in and takes checkpoints at system/user ends.
    ``use_cache`` False: the prefix cache is neither read nor written. ``teacher_ids``
    (exactness measurements): decode feeds exactly these tokens, through the same decode
    loop, and the handle keeps every step's logprobs.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    boundaries: tuple[tuple[int, str], ...] = ()
    use_cache: bool = True
    teacher_ids: tuple[int, ...] = ()
    # a measurement, not a turn (verify against cold, docs/DESIGN.md §18): the cache serves
    # it as it would a turn, but its lookup and hits are not counted, it stores no entry,
    # the resident cache stays as it was, and the stats' last turn is not replaced
    measure: bool = False

    @classmethod
    def from_plain(cls, data: dict[str, Any]) -> GenerateRequest:
        """The request that :func:`plain` (or ``dataclasses.asdict``) made ``data`` of,
        lists back to tuples (the rank wire, docs/DESIGN.md §19)."""
        sampling = SamplingParams(**{k: _tuples(v) for k, v in data["sampling"].items()})
        rest = {k: _tuples(v) for k, v in data.items() if k != "sampling"}
        return cls(sampling=sampling, **rest)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


@dataclass(frozen=True)
class PrefillProgress:
    """Prompt processing progress: ``done`` of ``total`` tokens prefilled, at ``tps`` tok/s."""

    done: int
    total: int
    tps: float = 0.0


@dataclass(frozen=True)
class TokenBatch:
    """Newly decoded tokens and the text they add (a delta, may be empty mid-codepoint)."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class TurnMetrics:
    """What one generation cost. Invariant: ``cached_tokens + prefill_tokens == prompt_tokens``.

    ``cached_by`` splits ``cached_tokens`` by tier (:data:`CACHE_SOURCES`), ``cached_kind``
    by entry kind (:data:`CACHE_KINDS`); each sums to ``cached_tokens``.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_by: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHE_SOURCES, 0))
    cached_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHE_KINDS, 0))
    prefill_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    peak_memory_bytes: int = 0
    finish_reason: str = "stop"  # "stop" | "length" | "cancelled"
    restore_s: float = 0.0  # seconds spent finding, loading and splicing cached entries
    restore_bytes: int = 0  # bytes of cached K/V and state put into the cache
    # the SSD tier read or its tokens computed again, with the estimates (core/cache/rates.py)
    restore_choice: str = ""
    # bytes of SSD files this request handed to the writer (docs/DESIGN.md §8.6)
    ssd_write_bytes: int = 0

    @property
    def cache_source(self) -> str:
        """The tier that gave the most tokens, or "cold"."""
        if not self.cached_tokens:
            return "cold"
        return max(self.cached_by, key=lambda k: self.cached_by[k])


@dataclass(frozen=True)
class RequestTrace:
    """What a request's run leaves to inspect (docs/DESIGN.md §20), declared here rather
    than attached to the handle: ``chunk_ends`` (the prefill's forwards, token positions
    after the restore), ``restored_position`` (prompt tokens the cache gave) and
    ``logprobs`` (the first ``Engine.record_logprobs`` steps' log-probability vectors,
    numpy arrays of shape ``(vocab,)``; every step's with ``teacher_ids``)."""

    chunk_ends: tuple[int, ...] = ()
    restored_position: int = 0
    logprobs: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Finished:
    """A reply that ended: its generated ``token_ids`` (a stop string's tokens included),
    its ``text`` (cut before a stop string), ``metrics`` and ``trace``
    (:class:`RequestTrace`); ``stop_sequence``: the stop string that ended it
    (``metrics.finish_reason`` "stop"), None otherwise."""

    token_ids: tuple[int, ...]
    text: str
    metrics: TurnMetrics
    trace: RequestTrace = RequestTrace()
    stop_sequence: str | None = None


@dataclass(frozen=True)
class Failed:
    """A request that did not complete, of one of the :data:`FailureKind` kinds: "error",
    "refused" (over the memory limit), "unsupported", "load" (a model load failed) or
    "cancelled" (the caller cancelled during prefill). ``kept_tokens``: prompt tokens a
    cancelled prefill kept in the cache (a retry restores them). ``permanent``: a refusal
    no wait cures (the request alone, with empty cache tiers, crosses the memory limit:
    docs/DESIGN.md §11); False for one that a later try may pass."""

    message: str
    kind: FailureKind = "error"
    kept_tokens: int = 0
    permanent: bool = False


@dataclass(frozen=True)
class ModelLoading:
    """Model load progress from the engine thread: ``done`` of ``total`` steps."""

    model: str
    done: int
    total: int
    message: str = ""


@dataclass(frozen=True)
class ModelLoaded:
    model: str
    warning: str | None = None


@dataclass(frozen=True)
class Stopping:
    """The caller asked the request to stop (sent at once, from the caller's thread): it
    leaves the engine at its next step (docs/DESIGN.md §20); a terminal event follows."""


Event = PrefillProgress | TokenBatch | Finished | Failed | ModelLoading | ModelLoaded | Stopping
EventCallback = Callable[[Event], None]


TERMINAL = (Finished, Failed, ModelLoaded)


class RequestHandle:
    """The caller's side of one submitted request.

    Events arrive from the engine thread; ``events()`` iterates them until a terminal one
    (:class:`Finished`, :class:`Failed`, or :class:`ModelLoaded` for a load), ``wait()``
    returns only the terminal event, and
    ``cancel()`` asks the engine to stop (decode stops within one token).
    """

    def __init__(self, on_event: EventCallback | None = None) -> None:
        self._queue: queue.Queue[Event] = queue.Queue()
        self._on_event = on_event
        self._cancel = threading.Event()
        self._cancel_lock = threading.Lock()
        self._done = threading.Event()
        self.result: Finished | Failed | ModelLoaded | None = None

    # engine side
    def emit(self, event: Event) -> None:
        # the handle is done before the callback hears of the terminal event, so a
        # callback (or whatever it wakes) can rely on ``done`` and ``result``
        terminal = isinstance(event, TERMINAL)
        if terminal:
            self.result = event
        self._queue.put(event)
        if terminal:
            self._done.set()
        if self._on_event is not None:
            self._on_event(event)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # caller side
    def cancel(self) -> None:
        """Ask the engine to stop this request at its next step; a :class:`Stopping`
        event goes out at once (once), unless the request already ended."""
        with self._cancel_lock:
            first = not self._cancel.is_set()
            self._cancel.set()
        if first and not self._done.is_set():
            self.emit(Stopping())

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def trace(self) -> RequestTrace:
        """The finished request's :class:`RequestTrace` (empty until it finished)."""
        result = self.result
        return result.trace if isinstance(result, Finished) else RequestTrace()

    def events(self) -> Iterator[Event]:
        while True:
            event = self._queue.get()
            yield event
            if isinstance(event, TERMINAL):
                return

    def wait(self, timeout: float | None = None) -> Finished | Failed | ModelLoaded:
        if not self._done.wait(timeout):
            raise TimeoutError("request did not finish in time")
        assert self.result is not None
        return self.result


# ---------------------------------------------------------------- stats snapshot


@dataclass(frozen=True)
class TierStats:
    """One tier's counters. Bytes in ``nbytes``/``max_bytes``; counters are totals since start."""

    entries: int = 0
    nbytes: int = 0
    max_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0  # bytes of the evicted entries (the SSD tier: under its cap)
    saves_queued: int = 0
    saves_persisted: int = 0
    write_drops: int = 0
    inline_writes: int = 0
    errors: int = 0
    corrupt: int = 0
    queue_depth: int = 0
    enabled: bool = True
    reason: str = ""


@dataclass(frozen=True)
class TailStats:
    """MRU partial tails and checkpoints. ``supported`` is None before a model is known."""

    entries: int = 0
    max_entries: int = 0
    nbytes: int = 0
    stashes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    tokens_saved: int = 0
    checkpoints: int = 0
    checkpoint_hits: int = 0
    supported: bool | None = None
    reason: str = ""

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(frozen=True)
class WearStats:
    """Bytes the SSD tier writes (docs/DESIGN.md §8.6): files written by this engine
    (``session_*``) and by every session of the cache dir (``total_*``); bytes written in
    the last 24 hours (``day_bytes``, whole hours) against ``budget_bytes`` (0: none);
    bytes accepted and not yet on disk (``pending_bytes``); entries kept in RAM until reused,
    evicted, due (``ssd_flush_idle_s`` after their commit) or closed (``deferred``), dropped because a longer entry holds their tokens
    (``skipped``: entries and bytes of arrays), refused by the budget (``budget_skips``)."""

    session_bytes: int = 0
    session_files: int = 0
    total_bytes: int = 0
    total_files: int = 0
    day_bytes: int = 0
    budget_bytes: int = 0
    pending_bytes: int = 0
    deferred: int = 0
    deferred_bytes: int = 0
    skipped: int = 0
    skipped_bytes: int = 0
    budget_skips: int = 0
    budget_skipped_bytes: int = 0
    enabled: bool = True


@dataclass(frozen=True)
class SnapshotStats:
    """Boundary snapshots of window/state layers stored with blocks."""

    count: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class ResidentStats:
    """The resident cache: the live cache of the last request, kept for the next one and
    cut back or extended in place (no copy). Its bytes count against the hot budget."""

    tokens: int = 0
    nbytes: int = 0
    hits: int = 0


@dataclass(frozen=True)
class LookupStats:
    """Requests by where their cached prefix came from, one count per request (not per
    block): ``resident`` (the last request's live cache cut back or extended in place,
    RAM), ``hot`` (entries in RAM: blocks, tails, checkpoints), ``ssd`` (most tokens
    read from disk), ``cold`` (nothing cached: a miss). ``tail`` counts the hits among
    them whose last tokens came from a tail or checkpoint entry (docs/DESIGN.md §10)."""

    resident: int = 0
    hot: int = 0
    ssd: int = 0
    cold: int = 0
    tail: int = 0

    @property
    def hits(self) -> int:
        return self.resident + self.hot + self.ssd

    @property
    def lookups(self) -> int:
        return self.hits + self.cold

    @property
    def hit_rate(self) -> float:
        """Hits over lookups, 0.0 before the first."""
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(frozen=True)
class MemoryStats:
    """Memory readings in bytes; ``level`` is "ok", "soft" or "hard", judged on
    ``max(active + cache, committed)``: ``committed`` is the weights, what the requests
    held have reserved and what the cache tiers hold (docs/DESIGN.md §11); ``peak`` is
    MLX's since the last prefill began, ``process_peak`` since the process started."""

    active: int = 0
    peak: int = 0
    cache: int = 0
    limit: int = 0
    device_total: int = 0
    system_total: int = 0
    system_available: int = 0
    level: str = "ok"
    committed: int = 0
    process_peak: int = 0  # the most MLX active memory since the process started
    waiting: int = 0  # queued requests waiting for memory to start (not refused)
    waited: int = 0  # requests that waited for memory at the queue's head, since the load


@dataclass(frozen=True)
class RankStats:
    """One rank's cache and memory figures when a model runs across several ranks
    (docs/DESIGN.md §19); rank 0 gathers them after each load, request and clear.

    Bytes in ``*_bytes``; ``memory_level`` is "ok", "soft" or "hard"; ``cached_hot`` and
    ``cached_ssd``: the tokens the rank's last restore took from each tier."""

    rank: int
    hot_bytes: int = 0
    hot_max_bytes: int = 0
    hot_entries: int = 0
    ssd_bytes: int = 0
    ssd_max_bytes: int = 0
    ssd_entries: int = 0
    memory_active_bytes: int = 0
    memory_limit_bytes: int = 0
    memory_level: str = "ok"
    cached_hot: int = 0
    cached_ssd: int = 0


RequestStatus = Literal["queued", "prefill", "decoding", "stopping"]


@dataclass(frozen=True)
class RequestState:
    """One request the engine holds: ``state`` (:data:`RequestStatus`), its prefill
    progress (``prefill_done`` of ``prefill_total`` tokens, after what the cache restored)
    and ``generated`` tokens so far (docs/DESIGN.md §20)."""

    uid: int
    state: RequestStatus = "queued"
    prompt_tokens: int = 0
    prefill_done: int = 0
    prefill_total: int = 0
    generated: int = 0

    def describe(self) -> str:
        """``prefill 512/3000``, ``decoding (37 tokens)``, ``queued`` or ``stopping…``."""
        if self.state == "prefill":
            return f"prefill {self.prefill_done}/{self.prefill_total}"
        if self.state == "decoding":
            return f"decoding ({self.generated} tokens)"
        return "stopping…" if self.state == "stopping" else "queued"


@dataclass(frozen=True)
class CacheStats:
    """One immutable snapshot of the whole cache, taken by ``Engine.stats()``.

    ``supported``: None (no model yet), True (every layer kind is known), False (caching
    is off for this model; ``reason`` says why). ``events`` are the most recent cache
    events (hits, evictions, clears, errors) as ``(seq, text)``, oldest first.
    """

    model: str = ""
    block_size: int = 256
    enabled: bool = True
    supported: bool | None = None
    reason: str = ""
    layer_kinds: tuple[str, ...] = ()
    hot: TierStats = TierStats()
    ssd: TierStats = TierStats()
    wear: WearStats = WearStats()
    tails: TailStats = TailStats()
    snapshots: SnapshotStats = SnapshotStats()
    resident: ResidentStats = ResidentStats()
    lookups: LookupStats = LookupStats()
    memory: MemoryStats = MemoryStats()
    last_turn: TurnMetrics = TurnMetrics()
    events: tuple[tuple[int, str], ...] = ()
    # every rank's figures when the model runs across several (rank 0 first), else ()
    ranks: tuple[RankStats, ...] = ()
    # the requests the engine holds now: decoding, then prefilling, then queued
    requests: tuple[RequestState, ...] = ()


class Tokenizer(Protocol):
    """What the prompt builder needs from a tokenizer (a HF ``PreTrainedTokenizerFast`` fits)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str | list[int]: ...


@dataclass(frozen=True)
class ModelInfo:
    """What callers may know of the loaded model, read once at its load (docs/DESIGN.md
    §3): ``context_length`` (tokens, from its config's ``max_position_embeddings``,
    ``max_seq_len`` or ``n_ctx``, or those of its ``text_config``; None: unknown),
    ``vocab_size`` (the logits' last dimension, the ids the model may generate; 0:
    unknown), ``device`` (``"cpu"`` or ``"gpu"``) and ``device_line``, the device and
    compute dtype for headers ("gpu (NVIDIA H100 80GB HBM3, cuda), bfloat16")."""

    context_length: int | None
    vocab_size: int
    device: str
    device_line: str = ""


class WritesFlushed(NamedTuple):
    """What a bounded stop did with the SSD writer's queue (docs/DESIGN.md §15): entries
    ``queued`` when it began, and entries ``written`` and ``dropped`` (not saved) during
    the whole stop."""

    queued: int = 0
    written: int = 0
    dropped: int = 0


class EngineLike(Protocol):
    """The engine interface the CLI and TUI program against (a fake implements it in tests)."""

    model_name: str

    @property
    def info(self) -> ModelInfo | None:
        """The loaded model's :class:`ModelInfo`; None while no model is loaded."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def eos_token_ids(self) -> set[int]: ...

    def submit(
        self, request: GenerateRequest, on_event: EventCallback | None = None
    ) -> RequestHandle: ...

    def load_model(self, model: str, on_event: EventCallback | None = None) -> RequestHandle: ...

    def stats(self) -> CacheStats: ...

    def clear(self, tier: str) -> None: ...

    def close(self) -> None: ...

    @property
    def writes_queued(self) -> int:
        """Entries the SSD writer has accepted and not yet written (0: none, or no tier)."""
        ...

    def shutdown(self, timeout_s: float, *, close: bool = True) -> WritesFlushed:
        """Stop within about ``timeout_s`` seconds: the SSD writer writes what it has
        queued, what it has not written by then is dropped, then the engine closes
        (unless ``close`` is False: its thread is left as it is, e.g. blocked in a
        collective with a lost rank)."""
        ...


def plain(value: Any) -> Any:
    """``value`` as JSON-ready data (a stats snapshot, metrics): dataclasses to dicts,
    tuples to lists, anything else that JSON lacks (paths) to ``str``."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
