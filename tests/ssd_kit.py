"""SSD-tier test entries: a fingerprint and seeded block/tail entries of two layers
(tests/unit/test_ssd_tier.py, tests/system/test_reliability.py)."""

from __future__ import annotations

import mlx.core as mx
from tierchat.core.cache.blocks import KIND_BLOCK, Entry, chain_ids, root_id, tail_id

FP = "ab" * 32


def entry(i: int, dtype=mx.float32, kind=KIND_BLOCK, parent=None, n=16) -> Entry:
    tokens = tuple(range(i * n, i * n + n))
    parent = parent or root_id(FP)
    eid = chain_ids(parent, tokens, n, 1)[0] if kind == KIND_BLOCK else tail_id(parent, tokens)
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(i)).astype(dtype)
    arrays = {"0.k": k, "0.v": k * 2, "1.k": k[:, :1], "1.v": -k[:, 1:]}
    mx.eval(list(arrays.values()))
    e = Entry(id=eid, parent=parent, kind=kind, start=0, tokens=tokens, role="user", arrays=arrays)
    e.nbytes = sum(a.nbytes for a in arrays.values())
    return e
