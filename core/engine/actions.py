"""The scheduler's actions and rank 0's messages: typed records, and their wire format
(docs/DESIGN.md §19, §20).

The scheduler (:mod:`.scheduler`) decides a step as a sequence of actions -- :class:`Cancel`,
:class:`Start`, :class:`Refuse`, :class:`Piece`, :class:`Group`, :class:`Decode` -- that the executor
(:mod:`.executor`) runs. Across ranks rank 0 sends each action to the workers before it
runs it, with the other jobs' messages (:class:`Load`, :class:`Admit`, :class:`ClearTier`,
:class:`Close`, :class:`Exit`), so one set of records is both the executor's input and the
ranks' wire. :func:`encode` turns a record into a JSON-able dict (``{"op": name, ...}``)
and :func:`decode` turns one back, field by field; an unknown op or field raises.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..api import GenerateRequest


@dataclass(frozen=True)
class Cancel:
    """End the requests ``uids`` (cancelled by their callers)."""

    uids: tuple[int, ...]


@dataclass(frozen=True)
class Start:
    """Restore queued request ``uid`` and move it to prefill (or straight to decode)."""

    uid: int


@dataclass(frozen=True)
class Refuse:
    """Refuse queued request ``uid`` for memory (docs/DESIGN.md §11): ``message`` says why;
    ``permanent`` when it can never fit, else the machine's free memory is short now."""

    uid: int
    message: str
    permanent: bool


@dataclass(frozen=True)
class Piece:
    """Prefill request ``uid`` (the head of the prefill queue) up to prompt position ``end``."""

    uid: int
    end: int


@dataclass(frozen=True)
class Group:
    """Prefill the rests of the requests ``uids`` in one forward of ``width`` columns (the
    longest rest, padded to one of few sizes; docs/DESIGN.md §20)."""

    uids: tuple[int, ...]
    width: int


@dataclass(frozen=True)
class Decode:
    """One batched decode step of every decoding request."""


@dataclass(frozen=True)
class Load:
    """Load model ``spec`` (every rank)."""

    spec: str


@dataclass(frozen=True)
class Admit:
    """Queue ``request`` as request ``uid`` (a worker's scheduler, as rank 0's)."""

    uid: int
    request: GenerateRequest


@dataclass(frozen=True)
class ClearTier:
    """Clear cache tier ``tier`` (``hot``, ``ssd``, ``tails``, ``resident`` or ``all``)."""

    tier: str


@dataclass(frozen=True)
class Close:
    """Rank 0's engine closed: flush and drop the model."""


@dataclass(frozen=True)
class Exit:
    """Rank 0 is done: the worker's loop ends."""


Action = Cancel | Start | Refuse | Piece | Group | Decode
Message = Action | Load | Admit | ClearTier | Close | Exit

OPS: dict[str, type] = {
    "cancel": Cancel,
    "start": Start,
    "refuse": Refuse,
    "piece": Piece,
    "group": Group,
    "decode": Decode,
    "load": Load,
    "admit": Admit,
    "clear": ClearTier,
    "close": Close,
    "exit": Exit,
}
_NAMES = {cls: op for op, cls in OPS.items()}


def op_name(message: Message) -> str:
    """The wire name of ``message``'s kind (``"piece"``, ``"load"``...)."""
    return _NAMES[type(message)]


def encode(message: Message) -> dict[str, Any]:
    """``message`` as a JSON-able dict: ``{"op": name, field: value...}``, tuples as lists,
    an :class:`Admit`'s request as a dict of its fields."""
    out: dict[str, Any] = {"op": op_name(message)}
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if isinstance(value, GenerateRequest):
            value = dataclasses.asdict(value)
        out[f.name] = value
    return out


def digest(uid: int, request: GenerateRequest) -> int:
    """A 56-bit digest of request ``uid`` (its uid, prompt and forced tokens): ranks
    compare it to know they start the same request (docs/DESIGN.md §19)."""
    h = hashlib.blake2b(digest_size=7)
    for ids in ((uid, len(request.prompt_ids)), request.prompt_ids, request.teacher_ids):
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def decode(data: dict[str, Any]) -> Message:
    """The record :func:`encode` made ``data`` from.

    Raises:
        ValueError: an unknown ``op``, or fields that are not the record's.
    """
    op = data.get("op")
    cls = OPS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ValueError(f"unknown message {op!r}")
    fields = {k: v for k, v in data.items() if k != "op"}
    names = {f.name for f in dataclasses.fields(cls)}
    if set(fields) != names:
        raise ValueError(f"{op} carries {sorted(fields)}, not {sorted(names)}")
    if cls is Admit:
        fields["request"] = request_from_wire(fields["request"])
    return cls(**{k: _tuples(v) for k, v in fields.items()})


def request_from_wire(fields: dict[str, Any]) -> GenerateRequest:
    """A :class:`~.api.GenerateRequest` from its ``dataclasses.asdict`` (JSON lists back to
    the tuples it holds: ids, ``(offset, role)`` pairs, and its nested
    :class:`~.sampling_params.SamplingParams`, stop strings included), by
    :meth:`~.api.GenerateRequest.from_plain`.

    Raises:
        ValueError: a field the request (or its sampling) does not have, or a sampling
            value out of range (a :class:`~.sampling_params.SamplingError`).
    """
    names = {f.name for f in dataclasses.fields(GenerateRequest)}
    unknown = set(fields) - names
    if unknown:
        raise ValueError(f"a request with unknown fields {sorted(unknown)}")
    try:
        return GenerateRequest.from_plain(fields)
    except TypeError as exc:  # a sampling field SamplingParams does not have
        raise ValueError(f"a request with bad sampling: {exc}") from exc


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
