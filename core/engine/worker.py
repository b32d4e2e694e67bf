"""A worker rank's loop: rank 0's messages, run on this rank's engine (docs/DESIGN.md §19).

Rank 0 sends each job and each of its scheduler's actions as a typed message
(:mod:`.actions`); the worker decodes it and runs it: a load, a clear, a close on the
engine; a request's ``admit`` and every scheduler action on its executor, which runs
them as rank 0's does (:meth:`.executor.Executor.follow`), so every rank's requests take
the same steps in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..api import Failed, RequestHandle
from .actions import Admit, Cancel, ClearTier, Close, Decode, Exit, Group, Load, Piece, Start
from .actions import decode as decode_message
from .distributed import RankError

_ACTIONS = (Cancel, Start, Piece, Group, Decode)


def serve_worker(engine: Any, log: Callable[[str], None] = print) -> bool:
    """The loop of a rank > 0, on its engine thread (``engine.call(...)``): take each of
    rank 0's messages and run it on this rank's engine.

    Returns True when rank 0 said exit, or ended after closing its engine (a clean end);
    False when it was lost with a model loaded or a message failed here (reported
    through ``log``).

    Raises:
        RankError: this process is not a worker of a group.
    """
    peers = engine.join_peers()
    if peers.is_main:
        raise RankError("serve_worker runs on ranks > 0 of a launched group")
    ranks = peers.ranks
    executor = engine.executor
    while True:
        try:
            # the last step's graph (computed ahead) is done before the next message: its
            # collectives and the message's meet rank 0's in one order
            mx.synchronize(generation_stream)
            data = ranks.broadcast()
        except RankError as exc:
            if engine.loaded is None:
                return True
            log(f"rank {ranks.rank}: rank 0 was lost ({exc})")
            return False
        op = data.get("op")
        try:
            msg = decode_message(data)
        except ValueError as exc:
            log(f"rank {ranks.rank}: unknown message {op!r} from rank 0 ({exc})")
            return False
        handle = RequestHandle()  # a load's events: nobody listens but this loop
        try:
            if isinstance(msg, _ACTIONS):
                executor.follow(msg)
                continue
            if isinstance(msg, Admit):  # the scheduler's queue, as on rank 0 (§20)
                executor.admit(msg.request, None, uid=msg.uid)
                continue
            if isinstance(msg, Load):
                engine.load_here(msg.spec, handle)
            elif isinstance(msg, ClearTier):
                engine.clear_here(msg.tier)
            elif isinstance(msg, Close):
                engine.close_model()
            elif isinstance(msg, Exit):
                return True
        except RankError as exc:
            log(f"rank {ranks.rank}: {op}: {exc}")
            return False
        except Exception as exc:  # noqa: BLE001 -- this rank is out of step: stop it
            log(f"rank {ranks.rank}: {op} failed: {type(exc).__name__}: {exc}")
            return False
        result = handle.result
        if isinstance(result, Failed) and result.kind not in ("cancelled",):
            log(f"rank {ranks.rank}: {op}: {result.message}")
