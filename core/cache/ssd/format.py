"""The SSD tier's file format (docs/DESIGN.md §8.4): encoding, parsing and checking; no
I/O beyond the bytes given.

File format ``tierchat-kv/2`` is a plain safetensors file (other tools open it; bf16 is
stored as ``BF16``)::

    u64 little-endian N | N bytes of JSON header, space padded to 8 | tensor data

The header must begin with ``{"__metadata__":{"hcrc":"XXXXXXXX","dcrc":"XXXXXXXX",`` where
``hcrc`` is the CRC-32 (zlib) of the 8 length bytes and the header with hcrc's own 8 hex
digits left out, and ``dcrc`` the CRC-32 of the data bytes: every byte of the file is
covered (CRC-32 catches every 1-bit error and every burst of up to 32 bits). The rest of
the metadata holds the format, model fingerprint, entry id, parent id, kind, start, token
ids, role and flags (``window``, ``snapshot``, and ``logprobs`` when a prompt tail keeps
its first token's logprobs, tensor ``logprobs``); a block's tokens must hash to its id (a
tail's to its tail id).
Tensors are contiguous, in name order.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..blocks import (
    FORMAT_VERSION,
    KIND_BLOCK,
    KIND_TAIL,
    TAIL_KINDS,
    Entry,
    EntryMeta,
    chain_ids,
)
from ..blocks import root_id as _root_id
from ..blocks import tail_id as _tail_id

FORMAT = f"tierchat-kv/{FORMAT_VERSION}"
PREFIX = b'{"__metadata__":{"hcrc":"'
HCRC_AT = 8 + len(PREFIX)  # byte offset of hcrc's 8 hex digits in the file
DCRC_AT = HCRC_AT + 8 + len(b'","dcrc":"')
MAX_HEADER = 16 << 20

# safetensors dtype name -> (MLX dtype, numpy dtype of the stored bits)
DTYPES: dict[str, tuple[mx.Dtype, type]] = {
    "BOOL": (mx.bool_, np.bool_),
    "U8": (mx.uint8, np.uint8),
    "I8": (mx.int8, np.int8),
    "U16": (mx.uint16, np.uint16),
    "I16": (mx.int16, np.int16),
    "U32": (mx.uint32, np.uint32),
    "I32": (mx.int32, np.int32),
    "U64": (mx.uint64, np.uint64),
    "I64": (mx.int64, np.int64),
    "F16": (mx.float16, np.float16),
    "BF16": (mx.bfloat16, np.uint16),  # numpy has no bfloat16: the bits as uint16
    "F32": (mx.float32, np.float32),
    "F64": (mx.float64, np.float64),
}
_NAME_OF = {mxd: name for name, (mxd, _) in DTYPES.items()}
_HEX = frozenset("0123456789abcdef")


@dataclass
class FileMeta(EntryMeta):
    """An index row: the entry's description plus its file's size and last access."""

    nbytes: int = 0  # file size (reserved at ``put``, before the file exists)
    atime: float = 0.0


class CorruptEntry(Exception):
    """An SSD entry (or arrays) that cannot be proven valid; the message says why."""


class Layout(NamedTuple):
    """A verified header: metadata strings, tensors ``(name, dtype, shape, begin, end)``
    with offsets relative to ``data_start``, and the data CRC the header promises."""

    meta: dict[str, str]
    tensors: list[tuple[str, str, tuple[int, ...], int, int]]
    data_start: int
    dcrc: int


# ---------------------------------------------------------------------- file format


def _hex8(value: int) -> bytes:
    return f"{value & 0xFFFFFFFF:08x}".encode()


def encode_header(meta: dict[str, str], tensors: list[tuple[str, str, tuple, int]]) -> bytes:
    """The length prefix and header of a file, CRC fields zeroed (:func:`seal_header`).

    ``tensors``: ``(name, dtype name, shape, nbytes)`` in file order.
    """
    body: dict = {"__metadata__": {"hcrc": "0" * 8, "dcrc": "0" * 8, **meta}}
    off = 0
    for name, dtype, shape, nbytes in tensors:
        body[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(body, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-aligned, as safetensors pads
    return struct.pack("<Q", len(raw)) + raw


def seal_header(head: bytes, dcrc: int) -> bytes:
    """``head`` (from :func:`encode_header`) with the data CRC and its own CRC filled in."""
    out = bytearray(head)
    out[DCRC_AT : DCRC_AT + 8] = _hex8(dcrc)
    out[HCRC_AT : HCRC_AT + 8] = _hex8(_header_crc(out))
    return bytes(out)


def _header_crc(head) -> int:
    mv = memoryview(head)
    return zlib.crc32(mv[HCRC_AT + 8 :], zlib.crc32(mv[:HCRC_AT]))


def parse_header(head, size: int) -> Layout:
    """Verify and parse the first ``8 + N`` bytes of a file of ``size`` bytes.

    Raises:
        CorruptEntry: not this format, bad hcrc, bad JSON, bad dtypes, shapes or offsets,
            or a size other than the header says (truncated or padded).
    """
    if bytes(head[8:HCRC_AT]) != PREFIX:
        raise CorruptEntry(f"not a {FORMAT} file")
    try:
        want = int(bytes(head[HCRC_AT : HCRC_AT + 8]), 16)
    except ValueError:
        raise CorruptEntry("bad header checksum field") from None
    if _header_crc(head) != want:
        raise CorruptEntry("header checksum mismatch")
    try:
        body = json.loads(bytes(head[8:]))
        meta = body.pop("__metadata__")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise ValueError("metadata values must be strings")
        tensors, off = [], 0
        for name, t in sorted(body.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype, shape, (begin, end) = t["dtype"], tuple(t["shape"]), t["data_offsets"]
            if dtype not in DTYPES or not all(isinstance(s, int) and s >= 0 for s in shape):
                raise ValueError(f"tensor {name}: bad dtype or shape")
            itemsize = np.dtype(DTYPES[dtype][1]).itemsize
            if begin != off or end - begin != math.prod(shape) * itemsize:
                raise ValueError(f"tensor {name}: bad offsets")
            tensors.append((name, dtype, shape, begin, end))
            off = end
        dcrc = int(meta["dcrc"], 16)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        raise CorruptEntry(f"bad header: {exc}") from None
    if len(head) + off != size:
        raise CorruptEntry(f"size {size} != {len(head) + off} (truncated or padded)")
    return Layout(meta, tensors, len(head), dcrc)


def _is_hex_id(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def entry_meta(meta: dict[str, str], fingerprint: str) -> EntryMeta:
    """The entry a verified header describes, after checking it belongs to this model and
    that its tokens hash to its id. Raises CorruptEntry saying what does not hold."""
    if meta.get("format") != FORMAT:
        raise CorruptEntry(f"format {meta.get('format')!r}, expected {FORMAT}")
    if meta.get("fingerprint") != fingerprint:
        raise CorruptEntry("entry of another model")
    try:
        tokens = tuple(json.loads(meta["tokens"]))
        m = EntryMeta(
            id=meta["id"],
            parent=meta["parent"],
            kind=meta["kind"],
            start=int(meta["start"]),
            tokens=tokens,
            role=meta["role"],
            window={"1": True, "0": False}[meta["window"]],
            snapshot={"1": True, "0": False}[meta["snapshot"]],
            # files written before kept logprobs existed have no such field
            logprobs={"1": True, "0": False}[meta.get("logprobs", "0")],
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptEntry(f"bad metadata: {exc}") from None
    if not (_is_hex_id(m.id) and _is_hex_id(m.parent)):
        raise CorruptEntry("bad id or parent")
    if not tokens or not all(type(t) is int and 0 <= t < 1 << 32 for t in tokens):
        raise CorruptEntry("bad tokens")
    if m.kind == KIND_BLOCK:
        want = chain_ids(m.parent, tokens, len(tokens), 1)[0]
    elif m.kind in TAIL_KINDS:
        want = _tail_id(m.parent, tokens)
    else:
        raise CorruptEntry(f"unknown kind {m.kind!r}")
    if want != m.id:
        raise CorruptEntry("tokens do not hash to the entry id")
    if m.start < 0 or (m.parent == _root_id(fingerprint) and m.start != 0):
        raise CorruptEntry("bad start")
    if m.logprobs and m.kind != KIND_TAIL:
        raise CorruptEntry(f"kept logprobs in a {m.kind} entry")
    return m


def _meta_strings(e: EntryMeta, fingerprint: str) -> dict[str, str]:
    return {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "id": e.id,
        "parent": e.parent,
        "kind": e.kind,
        "start": str(e.start),
        "tokens": json.dumps(list(e.tokens), separators=(",", ":")),
        "role": e.role,
        "window": "1" if e.window else "0",
        "snapshot": "1" if e.snapshot else "0",
        # only where set: an entry without kept logprobs writes the format it always did
        **({"logprobs": "1"} if e.logprobs else {}),
    }


def entry_header(e: Entry, fingerprint: str) -> tuple[bytes, int]:
    """An entry's file header (:func:`encode_header`, CRC fields zeroed) and the bytes of
    its tensors, which follow the header in name order. Raises ValueError when an array's
    dtype cannot be stored."""
    specs = []
    for name in sorted(e.arrays):
        a = e.arrays[name]
        dtype = _NAME_OF.get(a.dtype)
        if dtype is None:
            raise ValueError(f"dtype {a.dtype} of {name} cannot be stored")
        specs.append((name, dtype, tuple(a.shape), a.nbytes))
    return encode_header(_meta_strings(e, fingerprint), specs), sum(s[3] for s in specs)


def check_arrays(arrays: dict, expected: dict[str, tuple], ntokens: int) -> None:
    """Raise CorruptEntry unless ``arrays`` has exactly the names/shapes/dtypes expected.

    ``expected[name] = (shape, dtype)`` where a ``-1`` in shape stands for ``ntokens``.
    Names absent from ``arrays`` are allowed only if the whole leaf part is optional, which
    the caller expresses by leaving them out of ``expected``.
    """
    for name, (shape, dtype) in expected.items():
        a = arrays.get(name)
        if a is None:
            raise CorruptEntry(f"missing tensor {name}")
        want = tuple(ntokens if s == -1 else s for s in shape)
        if tuple(a.shape) != want or a.dtype != dtype:
            raise CorruptEntry(
                f"tensor {name}: {tuple(a.shape)} {a.dtype}, expected {want} {dtype}"
            )
