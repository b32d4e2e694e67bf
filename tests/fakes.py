"""Pure-Python stand-ins for the tokenizer and the engine (no MLX), for unit and Pilot tests.

``FakeTokenizer`` is byte-level-ish: every character is one id, except a few common
character pairs that ``encode`` merges into one id. ``FakeEngine`` "generates" one id per
character, so re-tokenizing a reply gives different ids than were generated -- the same
trap a real BPE tokenizer sets, which the splicing in ``core/chat/prompts.py`` must handle.

``FakeEngine`` implements ``EngineLike`` (core/api.py): one worker thread serves requests in
order, like the real engine's MLX thread. Replies are deterministic ("Reply N to: <last
user text>", N counts submits from 1), timings are modelled from token counts unless a
clock is given, and a small prefix-cache model makes the stats move like the real one.

Import from tests as ``from fakes import FakeEngine`` (pytest puts ``tests/`` on sys.path)
or ``from tests.fakes import FakeEngine`` (from the repository root).
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from tierchat.core.api import (
    CACHE_KINDS,
    CACHE_SOURCES,
    CACHE_TIERS,
    CacheStats,
    EventCallback,
    Failed,
    Finished,
    GenerateRequest,
    LookupStats,
    MemoryStats,
    ModelInfo,
    ModelLoaded,
    ModelLoading,
    PrefillProgress,
    RequestHandle,
    RequestTrace,
    ResidentStats,
    TailStats,
    TierStats,
    TokenBatch,
    TurnMetrics,
    WritesFlushed,
)
from tierchat.core.cache.blocks import common_prefix_len
from tierchat.core.stop_strings import StopStrings

SPECIAL_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
PAD_ID = 0
SYSTEM_ID, USER_ID, ASSISTANT_ID, END_ID = 1, 2, 3, 4
# Pairs that encode() merges into one id; generation never produces them.
MERGES: tuple[str, ...] = ("th", "he", "in", "er", "an", "Re", "ly", "to", "o:", "ou", "ll")
_MERGE_BASE = 8
_CHAR_BASE = 256
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")


class FakeTokenizer:
    """Characters <-> ids with a few merged pairs and four special tokens.

    Ids: 0 pad, 1-4 the specials ``<|system|>``, ``<|user|>``, ``<|assistant|>``,
    ``<|end|>`` (EOS), 8.. the merged pairs, 256 + ord(c) for any other character.
    Chat template: ``<|role|>content<|end|>\\n`` per message, ``<|assistant|>`` as the
    generation prompt.
    """

    eos_token_id = END_ID
    pad_token_id = PAD_ID
    chat_template = None  # its template is apply_chat_template below: no tools, no markers

    def __init__(self) -> None:
        self.eos_token_ids: set[int] = {END_ID}
        self._special_to_id = {s: i + 1 for i, s in enumerate(SPECIAL_TOKENS)}
        self._merge_to_id = {m: _MERGE_BASE + i for i, m in enumerate(MERGES)}
        self._id_to_piece = {i: s for s, i in self._special_to_id.items()}
        self._id_to_piece.update({i: m for m, i in self._merge_to_id.items()})

    @property
    def vocab_size(self) -> int:
        return _CHAR_BASE + 0x110000

    def get_vocab(self) -> dict[str, int]:
        """The specials and merged pairs (what reply-format inference reads; no think or
        tool-call tokens)."""
        return {**self._special_to_id, **self._merge_to_id}

    def char_ids(self, text: str) -> list[int]:
        """One id per character, no merges, no specials: what the fake engine generates."""
        return [_CHAR_BASE + ord(c) for c in text]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings become their ids; other text merges pairs left to right."""
        ids: list[int] = []
        for part in _SPECIAL_RE.split(text):
            if not part:
                continue
            if part in self._special_to_id:
                ids.append(self._special_to_id[part])
                continue
            i = 0
            while i < len(part):
                pair = part[i : i + 2]
                if len(pair) == 2 and pair in self._merge_to_id:
                    ids.append(self._merge_to_id[pair])
                    i += 2
                else:
                    ids.append(_CHAR_BASE + ord(part[i]))
                    i += 1
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Ids back to text; specials are kept unless ``skip_special_tokens``. Raises
        ``ValueError`` for an id outside the vocabulary."""
        out = []
        for i in ids:
            i = int(i)
            if i >= _CHAR_BASE:
                out.append(chr(i - _CHAR_BASE))
            elif i in self._id_to_piece:
                piece = self._id_to_piece[i]
                if skip_special_tokens and piece in self._special_to_id:
                    continue
                out.append(piece)
            elif i == PAD_ID:
                continue
            else:
                raise ValueError(f"unknown token id {i}")
        return "".join(out)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs,
    ) -> str | list[int]:
        """Render ``messages`` ({"role", "content"}); ids when ``tokenize`` (HF's default)."""
        text = "".join(f"<|{m['role']}|>{m['content']}<|end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text


LONG_STORY_HOLD_S = 60.0
"""How long the first reply to a "long story" prompt holds after its first token batch
(with ``token_delay_s`` set), waiting for a stop."""

_LAST_USER_RE = re.compile(r"<\|user\|>(.*?)<\|end\|>", re.DOTALL)


class FakeEngine:
    """An ``EngineLike`` without MLX. Thread-safe; one worker thread serves requests in order.

    Options:
        model_name: the name reported in stats and ``ModelLoaded``.
        supported: False models an unsupported model: generation works, caching is off and
            ``stats().supported`` is False with a reason.
        block_size: tokens per cache block (small by default so short test chats hit).
        clock: None (default) models timings from token counts, so metrics are
            deterministic (``prefill_tps``, ``generation_tps`` below). Given a clock, TTFT
            and rates are measured with it; a fixed clock gives 0.0 everywhere.
        token_delay_s: sleep between token batches (for watching a stream in the TUI).
        batch_size: tokens per ``TokenBatch``.
        reasoning: when set, every reply starts with ``<think>reasoning</think>`` (a
            reasoning model's shape).
        context_length: the model's context in tokens (its ``info.context_length``, as
            the real engine's ``ModelInfo``; here 4096 by default, tiny models have 131072).
        tokenizer: another tokenizer in place of :class:`FakeTokenizer` (a tiny model's,
            whose template renders tools); replies are then its ``encode`` + its EOS id.
        replies: scripted reply texts, used in order before the default ones (a tool call
            in the model's markup, which random weights never write).

    A cancel seen before the first token (during "prefill") ends the request with
    ``Failed(kind="cancelled")``, as the real engine does.

    Test switches: ``fail_next`` (a message: the next submit or load emits ``Failed``),
    ``gate`` (a ``threading.Event``; clear it to hold decode after the first batch),
    ``requests`` (every ``GenerateRequest`` submitted, in order).
    """

    def __init__(
        self,
        model_name: str = "fake",
        *,
        supported: bool = True,
        block_size: int = 16,
        hot_max_bytes: int = 64 << 20,
        ssd_max_bytes: int = 1 << 30,
        tail_entries: int = 8,
        clock: Callable[[], float] | None = None,
        prefill_tps: float = 400.0,
        generation_tps: float = 40.0,
        token_delay_s: float = 0.0,
        batch_size: int = 4,
        reasoning: str | None = None,
        context_length: int = 4096,
        tokenizer=None,
        replies: list[str] | None = None,
    ) -> None:
        self.model_name = model_name
        self.context_length = context_length
        self.supported = supported
        self.block_size = block_size
        self.hot_max_bytes = hot_max_bytes
        self.ssd_max_bytes = ssd_max_bytes
        self.tail_entries = tail_entries
        self.clock = clock
        self.prefill_tps = prefill_tps
        self.generation_tps = generation_tps
        self.token_delay_s = token_delay_s
        self.batch_size = batch_size
        self.reasoning = reasoning
        self.block_nbytes = block_size * 4096  # modelled KV bytes per block
        self.fail_next: str | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.requests: list[GenerateRequest] = []
        self.closed = False

        self._tokenizer = tokenizer or FakeTokenizer()
        self._eos = END_ID if tokenizer is None else min(tokenizer.eos_token_ids)
        self.replies = list(replies or ())
        self._lock = threading.Lock()
        self._submits = 0
        self._stories_told: set[tuple[int, ...]] = set()
        """Prompts whose long story was asked for once (see ``_generate``)."""
        self._hot: dict[tuple[int, ...], None] = {}  # block prefixes, LRU order
        self._ssd: set[tuple[int, ...]] = set()
        self._tails: list[tuple[int, ...]] = []  # whole sequences, MRU last
        self._checkpoints: dict[tuple[int, ...], None] = {}  # prompts, LRU order
        # the last cached request's prompt: the resident cache and its first-token logprobs
        self._resident: tuple[int, ...] | None = None
        self._resident_hits = 0
        self._resident_tokens = 0  # prompt + reply
        self._lookups = dict.fromkeys(("resident", "hot", "ssd", "cold", "tail"), 0)
        self._hot_counts = {"hits": 0, "misses": 0, "evictions": 0, "saves_queued": 0}
        self._ssd_counts = {"hits": 0, "misses": 0, "evictions": 0, "saves_persisted": 0}
        self._tail_counts = {
            "stashes": 0,
            "hits": 0,
            "misses": 0,
            "evictions": 0,
            "tokens_saved": 0,
            "checkpoint_hits": 0,
        }
        self._last_turn = TurnMetrics()
        self._events: list[tuple[int, str]] = []
        self._seq = 0
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="fake-engine", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ EngineLike

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self._tokenizer.eos_token_ids)

    def submit(self, request: GenerateRequest, on_event: EventCallback | None = None):
        """Queue one generation; events arrive on the worker thread. Raises ``RuntimeError``
        after ``close()``."""
        if self.closed:
            raise RuntimeError("engine is closed")
        handle = RequestHandle(on_event)
        with self._lock:
            self.requests.append(request)
            fail, self.fail_next = self.fail_next, None
        self._queue.put(("generate", request, handle, fail))
        return handle

    def load_model(self, model: str, on_event: EventCallback | None = None) -> RequestHandle:
        """Emit three ``ModelLoading`` steps, then the terminal ``ModelLoaded`` (with a
        warning for an unsupported model); ``Failed(kind="load")`` when ``fail_next`` is set."""
        if self.closed:
            raise RuntimeError("engine is closed")
        handle = RequestHandle(on_event)
        with self._lock:
            fail, self.fail_next = self.fail_next, None
        self._queue.put(("load", model, handle, fail))
        return handle

    def stats(self) -> CacheStats:
        """One immutable snapshot of the modelled cache."""
        with self._lock:
            reason = "" if self.supported else "fake: unsupported layer kind FakeCache"
            hot = TierStats(
                entries=len(self._hot),
                nbytes=len(self._hot) * self.block_nbytes,
                max_bytes=self.hot_max_bytes,
                enabled=self.supported,
                reason=reason,
                **self._hot_counts,
            )
            ssd = TierStats(
                entries=len(self._ssd),
                nbytes=len(self._ssd) * self.block_nbytes,
                max_bytes=self.ssd_max_bytes,
                saves_queued=self._hot_counts["saves_queued"],
                enabled=self.supported,
                reason=reason,
                **self._ssd_counts,
            )
            tails = TailStats(
                entries=len(self._tails),
                max_entries=self.tail_entries,
                nbytes=sum(len(t) % self.block_size for t in self._tails) * 4096,
                checkpoints=len(self._checkpoints),
                supported=self.supported,
                reason=reason,
                **self._tail_counts,
            )
            return CacheStats(
                model=self.model_name,
                block_size=self.block_size,
                enabled=self.supported,
                supported=self.supported,
                reason=reason,
                layer_kinds=("sliceable",) if self.supported else ("unknown",),
                hot=hot,
                ssd=ssd,
                tails=tails,
                memory=MemoryStats(
                    active=200 << 20,
                    peak=300 << 20,
                    cache=len(self._hot) * self.block_nbytes,
                    limit=8 << 30,
                    device_total=16 << 30,
                    system_total=16 << 30,
                    system_available=8 << 30,
                ),
                resident=ResidentStats(
                    tokens=self._resident_tokens if self._resident else 0,
                    nbytes=self._resident_tokens * 4096 if self._resident else 0,
                    hits=self._resident_hits,
                ),
                lookups=LookupStats(**self._lookups),
                last_turn=self._last_turn,
                events=tuple(self._events[-50:]),
            )

    def clear(self, tier: str) -> None:
        """Empty ``tier`` ("hot", "ssd", "tails", "all" or, as the real engine,
        "resident") and log an event. Raises ``ValueError`` for another name."""
        if tier not in (*CACHE_TIERS, "resident"):
            raise ValueError(f"unknown cache tier {tier!r}; expected one of {CACHE_TIERS}")
        with self._lock:
            if tier in ("hot", "all", "resident"):
                self._resident = None
            if tier in ("hot", "all"):
                self._log(f"cleared hot tier ({len(self._hot)} blocks)")
                self._hot.clear()
            if tier in ("ssd", "all"):
                self._log(f"cleared ssd tier ({len(self._ssd)} blocks)")
                self._ssd.clear()
            if tier in ("tails", "all"):
                self._log(f"cleared tails ({len(self._tails) + len(self._checkpoints)} entries)")
                self._tails.clear()
                self._checkpoints.clear()

    @property
    def info(self) -> ModelInfo | None:
        """``context_length`` as set (vocabulary unknown), None while no model is loaded."""
        return ModelInfo(self.context_length, 0, "cpu") if self.model_name else None

    writes_queued = 0  # no SSD writer

    def shutdown(self, timeout_s: float, *, close: bool = True) -> WritesFlushed:
        """As the real engine's, without an SSD writer: nothing queued, written or dropped."""
        if close:
            self.close()
        return WritesFlushed()

    def close(self) -> None:
        """Stop the worker after the requests already queued."""
        if not self.closed:
            self.closed = True
            self.gate.set()
            self._queue.put(None)
            self._worker.join(timeout=5)

    # ------------------------------------------------------------------ worker

    def _log(self, text: str) -> None:
        self._seq += 1
        self._events.append((self._seq, text))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, arg, handle, fail = item
            try:
                if fail is not None:
                    handle.emit(Failed(fail, "load" if kind == "load" else "error"))
                elif kind == "load":
                    self._load(arg, handle)
                else:
                    self._generate(arg, handle)
            except Exception as e:  # noqa: BLE001 -- a bug in a callback must not kill the worker
                if not handle.done:
                    handle.emit(Failed(f"{type(e).__name__}: {e}", "error"))

    def _load(self, model: str, handle: RequestHandle) -> None:
        for i in range(3):
            handle.emit(ModelLoading(model, i + 1, 3, f"step {i + 1} of 3"))
        with self._lock:  # the real engine makes a new cache: its events and counters restart
            self.model_name = model
            self._seq, self._events = 0, []
            self._lookups = dict.fromkeys(self._lookups, 0)
        warning = None if self.supported else "caching is off: unsupported layer kind"
        handle.emit(ModelLoaded(model, warning))

    def _lookup(self, prompt: tuple[int, ...]) -> tuple[dict[str, int], dict[str, int]]:
        """Cached tokens of ``prompt`` by tier and by entry kind: the whole prompt when it is
        the last request's (the resident cache with its first-token logprobs, as the real
        engine on a plain attention model), or through the tail that an earlier request of
        the same prompt kept with its first token's logprobs (the folded schedule: a
        prompt that does not end on a block end, every block still held), else at most
        all but the last token (fed to get logits)."""
        cached_by = dict.fromkeys(CACHE_SOURCES, 0)
        cached_kind = dict.fromkeys(CACHE_KINDS, 0)
        if prompt == self._resident:
            cached_by["hot"] = cached_kind["resident"] = len(prompt)
            self._resident_hits += 1
            return cached_by, cached_kind
        bs = self.block_size
        kept = prompt in self._checkpoints and len(prompt) % bs != 0
        limit = len(prompt) - (0 if kept else 1)
        n_blocks = 0
        while (n_blocks + 1) * bs <= limit:
            key = prompt[: (n_blocks + 1) * bs]
            if key in self._hot:
                self._hot[key] = self._hot.pop(key)  # LRU touch
                cached_by["hot"] += bs
                self._hot_counts["hits"] += 1
            elif key in self._ssd:
                cached_by["ssd"] += bs
                self._ssd_counts["hits"] += 1
                self._hot[key] = None  # promoted
            else:
                break
            n_blocks += 1
        done = n_blocks * bs
        cached_kind["block"] = done
        if kept and n_blocks == len(prompt) // bs:
            cached_by["hot"] += limit - done
            cached_kind["tail"] = limit - done  # the kept tail: no token prefilled
            self._tail_counts["hits"] += 1
            self._tail_counts["tokens_saved"] += limit - done
            return cached_by, cached_kind
        limit = len(prompt) - 1
        if done < limit and prompt in self._checkpoints:
            cached_by["hot"] += limit - done
            cached_kind["checkpoint"] = limit - done  # regenerate: exact state at N-1
            self._tail_counts["checkpoint_hits"] += 1
        elif done < limit:
            self._hot_counts["misses"] += 1
            best = max((common_prefix_len(t, prompt) for t in self._tails), default=0)
            best = min(best, limit)
            if best > done and best - done < bs:
                cached_by["hot"] += best - done
                cached_kind["tail"] = best - done
                self._tail_counts["hits"] += 1
                self._tail_counts["tokens_saved"] += best - done
            else:
                self._tail_counts["misses"] += 1
        return cached_by, cached_kind

    def _store(self, prompt: tuple[int, ...], seq: tuple[int, ...]) -> None:
        bs = self.block_size
        self._resident, self._resident_tokens = prompt, len(seq)
        self._checkpoints.pop(prompt, None)
        self._checkpoints[prompt] = None
        if len(self._checkpoints) > 32:
            self._checkpoints.pop(next(iter(self._checkpoints)))
        for end in range(bs, len(seq) + 1, bs):
            key = seq[:end]
            if key not in self._hot:
                self._hot[key] = None
                self._hot_counts["saves_queued"] += 1
            if key not in self._ssd:
                self._ssd.add(key)
                self._ssd_counts["saves_persisted"] += 1
        while len(self._hot) * self.block_nbytes > self.hot_max_bytes:
            self._hot.pop(next(iter(self._hot)))
            self._hot_counts["evictions"] += 1
            self._log("hot eviction (1 block)")
        if len(seq) % bs:
            self._tails.append(seq)
            self._tail_counts["stashes"] += 1
            if len(self._tails) > self.tail_entries:
                self._tails.pop(0)
                self._tail_counts["evictions"] += 1

    def _reply_text(self, prompt: tuple[int, ...]) -> str:
        if self.replies:
            return self.replies.pop(0)
        text = self._tokenizer.decode(prompt)
        users = _LAST_USER_RE.findall(text)
        reply = f"Reply {self._submits} to: {users[-1] if users else ''}"
        return f"<think>{self.reasoning}</think>{reply}" if self.reasoning else reply

    def _generate(self, request: GenerateRequest, handle: RequestHandle) -> None:
        prompt = tuple(request.prompt_ids)
        t0 = self.clock() if self.clock else 0.0
        with self._lock:
            self._submits += 1
            caching = self.supported and request.use_cache
            cached_by, cached_kind = (
                self._lookup(prompt)
                if caching
                else (dict.fromkeys(CACHE_SOURCES, 0), dict.fromkeys(CACHE_KINDS, 0))
            )
            if caching and sum(cached_by.values()):
                self._log(f"hit {sum(cached_by.values())}/{len(prompt)} tokens")
                where = "resident" if cached_kind["resident"] else "hot"
                where = "ssd" if cached_by["ssd"] > cached_by["hot"] else where
                self._lookups[where] += 1
                self._lookups["tail"] += bool(cached_kind["tail"] or cached_kind["checkpoint"])
            elif caching:
                self._lookups["cold"] += 1
                self._log(f"miss: nothing cached for {len(prompt)} tokens, all prefilled")
            if caching:  # the request takes the resident cache; stored again at its end
                self._resident = None
        cached = sum(cached_by.values())
        prefill = len(prompt) - cached
        handle.emit(PrefillProgress(0, prefill, 0.0))
        if handle.cancelled:
            why = f"cancelled during prefill; kept {cached} of {len(prompt)} tokens"
            handle.emit(Failed(why, "cancelled", kept_tokens=cached))
            return
        handle.emit(PrefillProgress(prefill, prefill, self.prefill_tps))
        t1 = self.clock() if self.clock else 0.0

        text = self._reply_text(prompt)
        # a request for a long story streams slowly, so that a key stops it on a loaded
        # machine; the first one for a prompt holds after its first batch until it is
        # stopped (at most LONG_STORY_HOLD_S), however late the key comes; a regenerate of it
        # streams at the slow pace and ends
        slow = "long story" in self._tokenizer.decode(prompt[-64:])
        with self._lock:
            hold = slow and self.token_delay_s > 0 and prompt not in self._stories_told
            if slow:
                self._stories_told.add(prompt)
        tok = self._tokenizer
        ids = (
            tok.char_ids(text)
            if isinstance(tok, FakeTokenizer)
            else tok.encode(text, add_special_tokens=False)
        )
        planned = [*ids, self._eos]
        budget = max(0, request.sampling.max_tokens)
        finish = "stop" if len(planned) <= budget else "length"
        planned = planned[:budget]
        out: list[int] = []
        first = True
        # the engine's own stop-string matcher: the text before a stop string is sent, the
        # stop string never is, and the reply ends there with finish reason "stop"
        stops, sent, hit = StopStrings(request.sampling.stop), "", False
        while len(out) < len(planned):
            if handle.cancelled:
                finish = "cancelled"
                break
            batch = planned[len(out) : len(out) + self.batch_size]
            out.extend(batch)
            text = self._tokenizer.decode([i for i in out if i != self._eos])
            safe, hit = stops.feed(text)
            handle.emit(TokenBatch(tuple(batch), safe[len(sent) :]))
            sent = safe
            if hit:
                finish = "stop"
                break
            if first:
                first = False
                while not self.gate.wait(0.01) and not handle.cancelled:
                    pass
            if hold:
                hold = False
                handle._cancel.wait(LONG_STORY_HOLD_S)
            elif self.token_delay_s:
                handle._cancel.wait(self.token_delay_s * (20 if slow else 1))
        t2 = self.clock() if self.clock else 0.0

        if self.clock is None:
            ttft = prefill / self.prefill_tps
            prefill_tps = self.prefill_tps
            gen_tps = self.generation_tps if out else 0.0
        else:
            ttft = t1 - t0
            prefill_tps = prefill / ttft if ttft > 0 else 0.0
            gen_tps = len(out) / (t2 - t1) if t2 > t1 else 0.0
        metrics = TurnMetrics(
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            cached_by=cached_by,
            cached_kind=cached_kind,
            prefill_tokens=prefill,
            ttft_s=ttft,
            prefill_tps=prefill_tps,
            generation_tokens=len(out),
            generation_tps=gen_tps,
            peak_memory_bytes=(300 << 20) + 4096 * (len(prompt) + len(out)),
            finish_reason=finish,
        )
        with self._lock:
            if caching:
                self._store(prompt, prompt + tuple(out))
            self._last_turn = metrics
        trace = RequestTrace()
        if request.teacher_ids:  # as the real engine: a teacher-forced run keeps logprobs
            vocab = max((*request.teacher_ids, *out)) + 1  # enough to index every id
            trace = RequestTrace(logprobs=tuple(np.full(vocab, -1.0, np.float32) for _ in out))
        shown = [i for i in out if i != self._eos]
        text = sent if hit else self._tokenizer.decode(shown)
        if not hit and len(text) > len(sent):
            handle.emit(TokenBatch((), text[len(sent) :]))  # what was held back
        handle.emit(Finished(tuple(out), text, metrics, trace, stops.matched if hit else None))
