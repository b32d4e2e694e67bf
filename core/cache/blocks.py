"""Block ids and cache entries.

A prompt's tokens are cut into blocks of ``block_size`` tokens; only full blocks are blocks.
Block ``j``'s id is ``sha256(id_{j-1} || tokens_j)`` with ``id_{-1}`` the *root*, a hash of
the model fingerprint (and the cache format version), so one id names one prefix of one
model: two models, or two prefixes that differ anywhere before the block, never share an
entry (the chained-hash scheme of vLLM's automatic prefix caching and oMLX's block cache).

A *tail* entry holds the tokens after a full block, ``[j * block_size, p)``: the sliceable
K/V of those tokens plus, for state layers, the snapshot at ``p``. Its id hashes the parent
block id and the tail tokens. Tails are what make a regenerate prefill one token; a prompt
tail captured at ``N`` on the folded schedule also keeps the logprobs of the first reply
token (:data:`LOGPROBS`), so a regenerate restored through it prefills none.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

FORMAT_VERSION = 2

# entry kinds: a full block, an MRU prompt tail (state at N-1), a sequence end after
# decoding (prompt + reply), a message-boundary checkpoint (end of a system/user message)
KIND_BLOCK = "block"
KIND_TAIL = "tail"
KIND_SEQ = "seq"
KIND_BOUNDARY = "boundary"
TAIL_KINDS = (KIND_TAIL, KIND_SEQ, KIND_BOUNDARY)

# the array key of a prompt tail's kept first-token logprobs (shape (vocab,))
LOGPROBS = "logprobs"

ROLE_PRIORITY = {"assistant": 0, "user": 1, "tail": 2, "system": 3}


def root_id(fingerprint: str) -> str:
    """The chain root for a model: sha256 of the format version and the model fingerprint."""
    return hashlib.sha256(f"tierchat-kv/{FORMAT_VERSION}/{fingerprint}".encode()).hexdigest()


def _token_bytes(tokens) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def chain_ids(root: str, tokens, block_size: int, n_blocks: int) -> list[str]:
    """Ids of the first ``n_blocks`` full blocks of ``tokens`` (one-off; see ChainHasher)."""
    return ChainHasher(root, block_size).ids(tokens, n_blocks)


class ChainHasher:
    """``chain_ids`` with memory: consecutive calls on growing or shared-prefix token
    sequences (a prompt, then prompt + reply) hash each block once, not once per call."""

    def __init__(self, root: str, block_size: int) -> None:
        self.root, self.block_size = root, block_size
        self._tokens: tuple[int, ...] = ()
        self._ids: list[str] = []

    def ids(self, tokens, n_blocks: int) -> list[str]:
        bs = self.block_size
        known = min(len(self._ids), n_blocks)
        head = tuple(tokens[: known * bs])
        if head != self._tokens[: known * bs]:
            known = 0  # cheap C-level comparison; on a mismatch rehash from the root
            for j in range(min(len(self._ids), n_blocks)):
                if tuple(tokens[j * bs : (j + 1) * bs]) != self._tokens[j * bs : (j + 1) * bs]:
                    break
                known = j + 1
        ids = self._ids[:known]
        parent = ids[-1] if ids else self.root
        for j in range(known, n_blocks):
            block = tokens[j * bs : (j + 1) * bs]
            parent = hashlib.sha256(bytes.fromhex(parent) + _token_bytes(block)).hexdigest()
            ids.append(parent)
        if n_blocks >= len(self._ids):
            self._tokens, self._ids = tuple(tokens[: n_blocks * bs]), ids
        return ids[:n_blocks]


def tail_id(parent: str, tokens) -> str:
    return hashlib.sha256(b"T" + bytes.fromhex(parent) + _token_bytes(tokens)).hexdigest()


@dataclass
class EntryMeta:
    """What names and describes a cached span of one prefix: tokens
    ``[start, start + len(tokens))`` after the entry ``parent``. ``window`` says every window
    leaf's K/V slice is present; ``snapshot`` says every state leaf's snapshot (at the end)
    is; ``logprobs`` says the entry (a prompt tail ending at the prompt's end) carries
    the logprobs the first reply token is sampled from, under :data:`LOGPROBS`. The SSD
    tier's index holds these for its files."""

    id: str
    parent: str
    kind: str
    start: int
    tokens: tuple[int, ...]
    role: str
    window: bool = True
    snapshot: bool = False
    logprobs: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def meta(self) -> dict[str, Any]:
        """The :class:`EntryMeta` fields as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(EntryMeta)}


@dataclass
class Entry(EntryMeta):
    """An entry with its data. ``arrays`` maps ``"<leaf>.<part>"`` to evaluated MLX arrays:
    ``"3.k"``/``"3.v"`` K/V slices ``(B, n_kv_heads, len(tokens), head_dim)`` for KV and
    window leaves, ``"5.s0"``... the snapshot of a state leaf at the entry's end, and
    :data:`LOGPROBS` the kept first-token logprobs when ``logprobs`` is set."""

    arrays: dict[str, Any] = field(default_factory=dict, repr=False)
    nbytes: int = 0
    snapshot_nbytes: int = 0
    # a sequence end's prompt length (its reply starts there; 0: unknown), in RAM only
    # (docs/DESIGN.md §8.6: a newer reply to the same prompt supersedes it)
    prompt_end: int = 0

    @property
    def priority(self) -> int:
        if self.kind != KIND_BLOCK:
            return ROLE_PRIORITY["tail"]
        return ROLE_PRIORITY.get(self.role, 1)


def role_at(boundaries, position: int) -> str:
    """The role of the message that contains the token just before ``position``."""
    for end, role in boundaries:
        if position <= end:
            return role
    return "assistant"


def common_prefix_len(a: Sequence[int], b: Sequence[int], stride: int = 256) -> int:
    """Length of the longest common prefix of two token sequences: compared a stride at a
    time (C-level slice equality), then token by token inside the first stride that
    differs."""
    if type(a) is not type(b):  # a tuple never equals a list: compare like with like
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + stride] == b[i : i + stride]:
        i += stride
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
