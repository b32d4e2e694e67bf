"""Several ranks, one model: MLX distributed groups, the messages rank 0 sends its workers,
agreement between ranks and a watchdog (docs/DESIGN.md §19).

Processes are started by ``mlx.launch`` (ring, MPI, JACCL or NCCL backends), which sets
``MLX_RANK`` and the backend's variables; :func:`current` then joins the group with
``mx.distributed.init()``. Rank 0 runs the UI (chat, serve, replay, cache commands); every
other rank runs a worker (:func:`.worker.serve_worker`) with no UI. All ranks run the same forward on
their own shard of the model, so every collective (the model's own ``all_sum`` calls and
the ones here) is made by every rank in the same order, on its engine thread.

The protocol, all over ``mx.distributed`` collectives:

- **Messages** (:meth:`Ranks.broadcast`): rank 0 sends a JSON object (the wire form of
  a typed message, :func:`.actions.encode`: ``load``, ``admit``, a scheduler action,
  ``clear``, ``close``, ``exit``) as one ``all_sum`` of an int64 vector -- its byte
  length, then its bytes packed 8 to a word (:data:`MESSAGE_WORDS` of them) -- to which
  every other rank adds zeros (as mlx-lm's server shares requests, ``mlx_lm/server.py``
  ``_share_object``, there in two calls); a longer message (a long prompt's ``admit``)
  sends the rest in a second one. Workers
  wait for the next message as long as rank 0 is idle, blocked on a doorbell socket
  (``doorbell.py``: no CPU) rather than in the ring's polling collective.
- **Agreement** (:meth:`Ranks.gather`, :meth:`Ranks.sum_ints`, :meth:`Ranks.all_min`):
  a request's start (chunk, request, restore position) in one ``gather``; its prefill's
  success with its first token in one ``all_sum``; cancels (``.ranks``).
- **Tokens**: rank 0 samples; each decode step's ``all_sum`` carries its token and its
  stop flag inside the step's graph (:meth:`Ranks.share_sampler`).
- **Faults**: a rank whose process ends breaks the ring's sockets, so the next collective
  raises ``RuntimeError`` on the others. A rank that stops answering leaves them blocked
  in a collective: on rank 0 a watchdog thread (:meth:`Ranks.section`) reports it after
  ``timeout_s`` without progress, with the stage it was in.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

from ..api import RankStats
from .actions import Exit, encode
from .doorbell import CONNECT_TIMEOUT_S, Doorbell, rank0_host

# variables a launcher sets for every rank (mlx.launch: MLX_RANK; mpirun: OMPI_*, PMI_*);
# cli/ranks.py reads the same without importing MLX
_RANK_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
DEFAULT_TIMEOUT_S = 120.0
# a message's words (8 bytes each) in its first all_sum: every action and a short admit fit
MESSAGE_WORDS = 128


# how MLX's distributed backends begin their errors ("[ring] connection to a peer was lost")
BACKEND_TAGS = ("[ring]", "[mpi]", "[jaccl]", "[nccl]")


def failure_of(exc: BaseException) -> str:
    """Why the ranks failed once ``exc`` broke a job: a backend's error from a collective
    (inside a model forward, say) means a rank was lost, said as :meth:`Ranks._sum` and
    the README say it; any other error leaves the ranks out of step."""
    if isinstance(exc, RuntimeError) and str(exc).startswith(BACKEND_TAGS):
        return f"a rank was lost: {exc}"
    return f"the ranks are out of step after {exc!r}"


class RankError(RuntimeError):
    """A rank died, stopped answering or failed where the others did not; the message
    names the rank (or the stage) and what happened."""


def launched() -> bool:
    """True when this process was started as one rank of several (by ``mlx.launch`` or
    ``mpirun``); reads the environment only, joins nothing."""
    return any(os.environ.get(v) for v in _RANK_VARS)


_LEVELS = ("ok", "soft", "hard")
_STAT_FIELDS = (
    "hot_bytes",
    "hot_max_bytes",
    "hot_entries",
    "ssd_bytes",
    "ssd_max_bytes",
    "ssd_entries",
    "memory_active_bytes",
    "memory_limit_bytes",
    "memory_level",
    "cached_hot",
    "cached_ssd",
)


def stats_vector(s: RankStats) -> list[int]:
    """``s`` as the fixed integer vector :meth:`Ranks.gather` sums."""
    return [
        _LEVELS.index(s.memory_level) if f == "memory_level" else int(getattr(s, f))
        for f in _STAT_FIELDS
    ]


def stats_from_vector(rank: int, row: Sequence[int]) -> RankStats:
    values: dict[str, Any] = dict(zip(_STAT_FIELDS, (int(x) for x in row), strict=True))
    values["memory_level"] = _LEVELS[min(max(values["memory_level"], 0), 2)]
    return RankStats(rank=rank, **values)


class Ranks:
    """This process's place in a group of ranks, and the collectives tierchat makes.

    Every method that communicates must be called by every rank, in the same order, on
    the engine thread (MLX streams belong to the thread that made them). Arrays are
    evaluated before a method returns, so a dead peer raises here (``RuntimeError`` from
    the backend, re-raised as :class:`RankError`, :attr:`failed` set); inside a model
    forward the engine sets :attr:`failed` when its job raises.
    """

    def __init__(self, group: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.timeout_s = float(timeout_s)
        # ring, MPI and JACCL reduce on the CPU; NCCL (mlx.launch sets NCCL_HOST_IP for
        # it) on the GPU's default stream
        nccl = bool(os.environ.get("NCCL_HOST_IP")) and mx.cuda.is_available()
        self.stream = None if nccl else mx.cpu
        self.failed = ""  # set by the watchdog or a collective that raised
        self.on_timeout: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._section: str | None = None
        self._last_tick = 0.0
        self._watchdog: threading.Thread | None = None
        self._bell: Doorbell | None = None  # in use on every rank once agreed
        self._pending_bell: Doorbell | None = None  # set up, not yet agreed on
        self._bell_tried = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ collectives
    def _sum(self, x: mx.array) -> mx.array:
        out = mx.distributed.all_sum(x, group=self.group, stream=self.stream)
        try:
            mx.eval(out)
        except RuntimeError as exc:
            self.failed = self.failed or f"a rank was lost: {exc}"
            raise RankError(f"a rank was lost ({exc})") from exc
        self.tick()
        return out

    def broadcast(self, message: dict | None = None) -> dict:
        """Rank 0's ``message`` (a JSON-able dict) on every rank; other ranks pass None.

        Raises:
            RankError: a rank was lost while sending.
        """
        bell = None
        if self.is_main:
            if self._bell is not None:
                self._bell.ring()
            elif not self._bell_tried:
                bell = self._open_bell()
                if bell is not None:
                    message = {**message, "_bell": bell}
            data = json.dumps(message, separators=(",", ":")).encode()
            got = self._send_words(data)
        else:
            if self._bell is not None and not self._bell.wait():
                self.failed = self.failed or "rank 0 was lost (its doorbell closed)"
                raise RankError("rank 0 was lost (its doorbell closed)")
            got = self._send_words(None)
        if self.is_main:
            if bell is not None:
                # well inside the watchdog's bound: a slow worker means no bell, not a failure
                wait_s = min(CONNECT_TIMEOUT_S, self.timeout_s / 4)
                self._agree_bell(self._pending_bell.accept(self.size - 1, wait_s))
                self.tick()
                message = {k: v for k, v in message.items() if k != "_bell"}
            return message
        out = json.loads(got)
        if "_bell" in out:
            address = out.pop("_bell")
            pending = Doorbell()
            ok = pending.connect((address[0], int(address[1])))
            self._pending_bell = pending
            self._agree_bell(ok)
        return out

    def sum_ints(self, x: mx.array) -> list[int]:
        """The element-wise sum of every rank's integer vector ``x`` (one shape on all
        ranks), as ints.

        Raises:
            RankError: a rank was lost.
        """
        return [int(v) for v in self._sum(x).tolist()]

    def _send_words(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (others pass None): one ``all_sum`` of a
        ``(1 + MESSAGE_WORDS,)`` int64 vector -- the byte length, then the bytes packed
        8 to a word, the other ranks adding zeros -- and a second one of the words that
        did not fit (a long prompt's ``admit``)."""
        head = np.zeros(1 + MESSAGE_WORDS, dtype=np.int64)
        words = None
        if data is not None:
            words = np.frombuffer(data + bytes(-len(data) % 8), dtype=np.int64)
            head[0] = len(data)
            head[1 : 1 + min(len(words), MESSAGE_WORDS)] = words[:MESSAGE_WORDS]
        got = np.array(self._sum(mx.array(head)), dtype=np.int64)
        size = int(got[0])
        rest = (size + 7) // 8 - MESSAGE_WORDS
        if rest > 0:
            tail = words[MESSAGE_WORDS:] if words is not None else np.zeros(rest, np.int64)
            got = np.concatenate([got, np.array(self._sum(mx.array(tail)), dtype=np.int64)])
        return got[1:].tobytes()[:size]

    def _open_bell(self) -> list | None:
        """Rank 0, first message: listen for the workers' doorbell connections; the
        address to send them, or None (no ring hostfile, or no socket)."""
        self._bell_tried = True
        host = rank0_host()
        if host is None:
            return None
        pending = Doorbell()
        address = pending.listen(host)
        if address is None:
            return None
        self._pending_bell = pending
        return [address[0], address[1]]

    def _agree_bell(self, ok: bool) -> None:
        """Every rank: use the doorbell only if every rank set it up (one ``all_min``)."""
        self._bell_tried = True
        pending, self._pending_bell = self._pending_bell, None
        if self.all_min(int(ok))[0] == 1:
            self._bell = pending
        else:
            pending.close()

    def send_exit(self) -> bool:
        """Rank 0, after its last engine closed: tell the workers to exit. The collective
        runs on a thread of its own that then ends its MLX streams, as an engine thread
        does (the process's main thread sending it after an engine restart failed on
        NCCL, two H200s: "NCCL error ... unhandled cuda error", rank 0 exit code 1).
        Returns whether it was sent (False: a rank was lost, or no answer within the
        timeout)."""
        sent: list[bool] = []

        def job() -> None:
            try:
                self.broadcast(encode(Exit()))
                sent.append(True)
            except RankError:
                pass
            finally:
                mx.synchronize()
                mx.clear_streams()

        thread = threading.Thread(target=job, name="tierchat-ranks-exit", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        return bool(sent)

    def all_min(self, values: Sequence[int] | int) -> list[int]:
        """The element-wise minimum of every rank's ``values`` (integers; one shape on all
        ranks); an int gives a one-element list."""
        x = mx.array([values] if isinstance(values, int) else list(values), dtype=mx.int64)
        out = mx.distributed.all_min(x, group=self.group, stream=self.stream)
        return self._eval_list(out)

    def all_max(self, values: Sequence[int] | int) -> list[int]:
        """The element-wise maximum, as :meth:`all_min`."""
        x = mx.array([values] if isinstance(values, int) else list(values), dtype=mx.int64)
        out = mx.distributed.all_max(x, group=self.group, stream=self.stream)
        return self._eval_list(out)

    def _eval_list(self, out: mx.array) -> list[int]:
        try:
            mx.eval(out)
        except RuntimeError as exc:
            self.failed = self.failed or f"a rank was lost: {exc}"
            raise RankError(f"a rank was lost ({exc})") from exc
        self.tick()
        return [int(v) for v in out.tolist()]

    def gather(self, row: Sequence[int]) -> list[list[int]]:
        """Every rank's ``row`` (integers, one length on all ranks), indexed by rank: one
        ``all_sum`` of a ``(size, len(row))`` matrix where each rank fills its own row."""
        x = mx.zeros((self.size, len(row)), dtype=mx.int64)
        x[self.rank] = mx.array(list(row), dtype=mx.int64)
        return [[int(v) for v in r] for r in self._sum(x).tolist()]

    def share_tokens(
        self, sampler: Callable[[mx.array], mx.array]
    ) -> Callable[[mx.array], mx.array]:
        """A sampler whose tokens are rank 0's on every rank: rank 0 samples with
        ``sampler``; the other ranks contribute zeros made to depend on their logprobs
        (shape ``(..., vocab)``), so the ``all_sum`` comes after the step's forward (and its
        collectives) on every rank. Tokens are int32 of shape ``logprobs.shape[:-1]``."""

        def shared(logprobs: mx.array) -> mx.array:
            if self.is_main:
                y = sampler(logprobs).astype(mx.int32)
            else:
                y = mx.depends(mx.zeros(logprobs.shape[:-1], dtype=mx.int32), logprobs)
            return mx.distributed.all_sum(y, group=self.group, stream=self.stream)

        return shared

    # ------------------------------------------------------------------ watchdog
    def tick(self) -> None:
        """Progress: the watchdog's clock starts again."""
        self._last_tick = time.monotonic()

    @contextmanager
    def section(self, stage: str) -> Iterator[None]:
        """On rank 0, watch the block: if it makes no progress (:meth:`tick`) for
        ``timeout_s`` seconds, :attr:`failed` is set and ``on_timeout(message)`` is
        called from the watchdog thread (the engine thread stays blocked in the
        collective; the caller reports and exits). A no-op on workers."""
        if not self.is_main:
            yield
            return
        self._start_watchdog()
        with self._lock:
            outer, self._section = self._section, stage
        self.tick()
        try:
            yield
        finally:
            with self._lock:
                self._section = outer  # sections nest: the request goes on being watched

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name="tierchat-rank-watchdog", daemon=True
            )
            self._watchdog.start()

    def _watch(self) -> None:
        while not self.failed:
            time.sleep(min(0.25, self.timeout_s / 4))
            with self._lock:
                stage = self._section
            if stage is None:
                continue
            idle = time.monotonic() - self._last_tick
            if idle > self.timeout_s:
                self.failed = (
                    f"a rank stopped answering: no progress for {idle:.0f} s during {stage} "
                    f"(timeout {self.timeout_s:g} s, {self.size} ranks)"
                )
                if self.on_timeout is not None:
                    self.on_timeout(self.failed)
                return


_current: Ranks | None = None
_init_lock = threading.Lock()


def current(timeout_s: float | None = None) -> Ranks | None:
    """This process's :class:`Ranks` (joining the group on the first call), or None when
    it was not launched as one of several ranks. Call it on the engine thread.

    Raises:
        RankError: launched, but the group could not be joined, or has one rank.
    """
    global _current
    if not launched():
        return None
    with _init_lock:
        if _current is None:
            try:
                group = mx.distributed.init(strict=True)
            except Exception as exc:  # noqa: BLE001 -- every backend raises its own kind
                raise RankError(f"cannot join the ranks ({type(exc).__name__}: {exc})") from exc
            if timeout_s is None:
                timeout_s = float(os.environ.get("TIERCHAT_RANK_TIMEOUT", DEFAULT_TIMEOUT_S))
            _current = Ranks(group, timeout_s)
        if timeout_s is not None:
            _current.timeout_s = float(timeout_s)
        return _current if _current.size > 1 else None
