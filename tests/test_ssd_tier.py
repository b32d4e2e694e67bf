"""The SSD tier on its own: round trips (bf16 included), index rebuild, LRU cap, permissions."""

from __future__ import annotations

import stat

import mlx.core as mx
import numpy as np
import pytest
from tierchat.core.cache.blocks import KIND_BLOCK, KIND_TAIL, Entry, chain_ids, root_id
from tierchat.core.cache.ssd import SSDTier

FP = "ab" * 32


def entry(i: int, dtype=mx.float32, kind=KIND_BLOCK, parent=None) -> Entry:
    tokens = tuple(range(i * 16, i * 16 + 16))
    eid = chain_ids(root_id(FP), tokens, 16, 1)[0]
    k = mx.random.normal((1, 2, 16, 8), key=mx.random.key(i)).astype(dtype)
    arrays = {"0.k": k, "0.v": k * 2}
    mx.eval(list(arrays.values()))
    e = Entry(
        id=eid,
        parent=parent or root_id(FP),
        kind=kind,
        start=0,
        tokens=tokens,
        role="user",
        arrays=arrays,
    )
    e.nbytes = sum(a.nbytes for a in arrays.values())
    return e


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_round_trip_is_bitwise(tmp_path, dtype):
    ssd = SSDTier(tmp_path, FP, 1 << 30)
    e = entry(1, dtype)
    assert ssd.put(e)
    ssd.flush()
    got = ssd.load(e.id)
    assert got is not None and got.tokens == e.tokens and got.kind == KIND_BLOCK
    for name, a in e.arrays.items():
        b = got.arrays[name]
        assert b.dtype == dtype and b.shape == a.shape
        assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
    path = ssd._path(e.id)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    ssd.close()


def test_index_rebuilt_from_headers(tmp_path):
    ssd = SSDTier(tmp_path, FP, 1 << 30)
    a, t = entry(1), entry(2, kind=KIND_TAIL)
    ssd.put(a)
    ssd.put(t)
    ssd.close()
    again = SSDTier(tmp_path, FP, 1 << 30)
    assert len(again) == 2 and again.nbytes > 0
    assert {m.id for m in again.children_of(root_id(FP))} == {a.id, t.id}
    assert again.tail_ids() == [t.id]
    assert again.corrupt == 0
    again.close()


def test_cap_evicts_least_recently_used(tmp_path):
    probe = SSDTier(tmp_path / "probe", FP, 1 << 30)
    probe.put(entry(0))
    probe.close()
    one = probe.nbytes
    ssd = SSDTier(tmp_path, FP, 2 * one + one // 2)  # room for two entries
    e1, e2, e3 = entry(1), entry(2), entry(3)
    ssd.put(e1)
    ssd.put(e2)
    ssd.flush()
    assert ssd.load(e1.id) is not None  # e1 is now more recent than e2
    ssd.put(e3)
    ssd.flush()
    assert e1.id in ssd and e3.id in ssd and e2.id not in ssd
    assert ssd.evictions == 1 and ssd.nbytes <= ssd.max_bytes
    ssd.close()


def test_shape_mismatch_is_a_miss_and_removes_the_file(tmp_path):
    ssd = SSDTier(tmp_path, FP, 1 << 30)
    e = entry(1)
    ssd.put(e)
    ssd.flush()
    wrong = {"0.k": ((1, 4, -1, 8), mx.float32), "0.v": ((1, 4, -1, 8), mx.float32)}
    assert ssd.load(e.id, expected=wrong) is None
    assert ssd.corrupt == 1 and e.id not in ssd and not ssd._path(e.id).exists()
    ssd.close()


def test_clear_removes_every_file(tmp_path):
    ssd = SSDTier(tmp_path, FP, 1 << 30)
    for i in range(3):
        ssd.put(entry(i))
    assert ssd.clear() == 3
    assert len(ssd) == 0 and ssd.nbytes == 0
    assert not list(ssd.dir.glob("*/*.safetensors"))
    ssd.close()
