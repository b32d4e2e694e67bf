"""Bounded SSD I/O (docs/DESIGN.md §8.4): no MLX array the tier makes to write or read a
file is over ``io.PIECE_BYTES``, whatever the entry's size. A test hook lowers the bound
to 64 KiB, so an entry of a few MiB stands for one over 2 GiB: written in many pieces,
read back through many staging pieces, bit for bit (bf16, tensors that straddle pieces,
offsets not a multiple of their item size)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from ssd_kit import FP
from tierchat.core.cache.blocks import KIND_BLOCK, Entry, chain_ids, root_id
from tierchat.core.cache.ssd import io as ssd_io
from tierchat.core.cache.ssd.reader import SSDReader
from tierchat.core.cache.ssd.tier import SSDTier

BOUND = 64 << 10


class Tier(SSDTier):
    verify_at_start = False  # the loads below read the files themselves


def bits(a: mx.array) -> np.ndarray:
    view = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[a.dtype.size]
    return np.array(a.view(view))


def big_entry(layers: int = 6, heads: int = 4, tokens: int = 1000, dim: int = 24) -> Entry:
    """K/V of ``layers`` layers, bf16 and f32 mixed, one head alone over the bound, and
    a bf16 tensor of an odd element count, so later offsets are not 4-aligned."""
    toks = tuple(range(tokens))
    parent = root_id(FP)
    arrays = {}
    key = mx.random.key(7)
    for layer in range(layers):
        dtype = mx.bfloat16 if layer % 2 else mx.float32
        for part in "kv":
            key, sub = mx.random.split(key)
            arrays[f"{layer}.{part}"] = mx.random.normal((1, heads, tokens, dim), key=sub).astype(
                dtype
            )
    arrays["0.odd"] = mx.arange(3, dtype=mx.bfloat16)  # name order: after 0.k, before 0.v
    mx.eval(list(arrays.values()))
    e = Entry(
        id=chain_ids(parent, toks, tokens, 1)[0],
        parent=parent,
        kind=KIND_BLOCK,
        start=0,
        tokens=toks,
        role="user",
        arrays=arrays,
    )
    e.nbytes = sum(a.nbytes for a in arrays.values())
    return e


@pytest.fixture(params=[False, True], ids=["staged", "by-path"])
def bound(monkeypatch, request):
    """A low piece bound, with both ways a file is loaded (by path, a tensor over the
    bound falls back to staging pieces)."""
    monkeypatch.setattr(ssd_io, "PIECE_BYTES", BOUND)
    monkeypatch.setattr(SSDReader, "by_path", request.param)
    return BOUND


def test_copy_pieces_split_by_heads_then_tokens(bound):
    kv = mx.random.normal((1, 4, 1000, 24), key=mx.random.key(1))  # 96,000 B a head
    small = mx.arange(10, dtype=mx.float32)
    pieces = ssd_io.copy_pieces([small, kv])
    mx.eval(pieces)
    assert all(p.dtype == mx.uint8 and p.size <= bound for p in pieces)
    # a head is over the bound: runs of tokens of one head, never across heads
    assert len(pieces) >= 4 * math.ceil(96_000 / bound)
    joined = b"".join(bytes(np.array(p)) for p in pieces)
    assert joined == np.array(small).tobytes() + np.array(kv).tobytes()


def test_staging_is_in_pieces(bound):
    stages = ssd_io.staging(5 * bound + 3)
    assert [s.size for s in stages] == [bound] * 5 + [3]
    assert ssd_io.staging(10)[0].size == 10


def test_an_entry_over_the_bound_round_trips_in_many_pieces(bound, tmp_path):
    """An entry many times the bound (as one over 2 GiB is many times 256 MiB): every
    piece the writer is handed is within the bound, the file is plain safetensors, and a
    restart reads it back equal, straight and read ahead."""
    e = big_entry()
    assert e.nbytes > 20 * bound
    ssd = SSDTier(tmp_path, FP, 1 << 30)
    ssd.pause("test")  # keep it pending to look at its pieces
    try:
        assert ssd.put(e)
        (item,) = ssd.writer.pending.values()
        assert len(item.pieces) > 20 and max(p.nbytes for p in item.pieces) <= bound
        ssd.resume("test")
        assert ssd.flush(60) and ssd.saves_persisted == 1
        on_disk = mx.load(str(ssd._path(e.id)))  # MLX's own reader: the whole tensors
        for name, a in e.arrays.items():
            assert np.array_equal(bits(on_disk[name]), bits(a)), name
    finally:
        ssd.close()
    for ahead in (False, True):
        fresh = Tier(tmp_path, FP, 1 << 30)
        try:
            if ahead:
                fresh.reader.read_ahead([e.id])
            got = fresh.load(e.id)
            assert got is not None and fresh.corrupt == 0 and fresh.errors == 0
            assert set(got.arrays) == set(e.arrays)
            for name, a in e.arrays.items():
                b = got.arrays[name]
                assert b.dtype == a.dtype and b.shape == a.shape, name
                assert np.array_equal(bits(b), bits(a)), name
        finally:
            fresh.close()


def test_a_corrupt_byte_in_a_later_piece_is_caught(bound, tmp_path):
    e = big_entry(layers=2)
    ssd = SSDTier(tmp_path, FP, 1 << 30)
    assert ssd.put(e) and ssd.flush(60)
    ssd.close()
    path = ssd._path(e.id)
    raw = bytearray(path.read_bytes())
    raw[-bound // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    fresh = Tier(tmp_path, FP, 1 << 30)
    try:
        assert fresh.load(e.id) is None and fresh.corrupt == 1
    finally:
        fresh.close()
