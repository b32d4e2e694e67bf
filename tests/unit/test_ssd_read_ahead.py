"""Reads ahead of an SSD restore (docs/DESIGN.md §8.4, core/cache/ssd/io.py ReadAhead and
reader.py SSDReader.read_ahead): each read lands in its own entry's staging arrays
whatever order the loads take them in; a reader thread's failure reaches the load that
takes it (a corrupt file refused and removed, a missing one forgotten); a drop or close
cancels the reads not started and waits for the running ones."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from ssd_kit import FP, entry
from tierchat.core.cache.ssd import io as ssd_io
from tierchat.core.cache.ssd.reader import SSDReader
from tierchat.core.cache.ssd.tier import SSDTier


@pytest.fixture(autouse=True, params=[False, True], ids=["staged", "by-path"])
def load_mode(request, monkeypatch):
    """Every test with both ways a file is loaded: read into staging arrays and viewed,
    or verified by the reader thread and read again by ``mx.load`` (CUDA's way)."""
    monkeypatch.setattr(SSDReader, "by_path", request.param)
    return request.param


class Tier(SSDTier):
    verify_at_start = False  # the loads below read the files themselves


def written(tmp_path, n: int):
    ssd = SSDTier(tmp_path, FP, 1 << 30)
    entries = [entry(i, mx.bfloat16) for i in range(n)]
    for e in entries:
        assert ssd.put(e)
    assert ssd.flush(60)
    ssd.close()
    return entries


def same(got, want) -> bool:
    return set(got.arrays) == set(want.arrays) and all(
        np.array_equal(np.array(got.arrays[k].view(mx.uint16)), np.array(a.view(mx.uint16)))
        for k, a in want.arrays.items()
    )


def test_reads_ahead_land_in_their_own_entries_in_any_order(tmp_path):
    entries = written(tmp_path, 6)
    fresh = Tier(tmp_path, FP, 1 << 30)
    try:
        fresh.reader.read_ahead([e.id for e in entries])
        assert all(e.id in fresh.reader.ahead for e in entries)
        for e in reversed(entries):  # the last read first
            got = fresh.load(e.id)
            assert got is not None and same(got, e)
        assert fresh.hits == 6 and fresh.corrupt == 0 and fresh.errors == 0
        assert not any(e.id in fresh.reader.ahead for e in entries)  # each taken once
    finally:
        fresh.close()


def test_a_reader_threads_failure_reaches_the_load(tmp_path):
    """A corrupt byte found by a reader thread: the load refuses the entry and removes
    its file; a file removed before its read: the load forgets it; the others load."""
    entries = written(tmp_path, 3)
    fresh = Tier(tmp_path, FP, 1 << 30)
    try:
        bad, gone, good = entries
        raw = bytearray(fresh._path(bad.id).read_bytes())
        raw[-3] ^= 0x10
        fresh._path(bad.id).write_bytes(bytes(raw))
        fresh._path(gone.id).unlink()
        fresh.reader.read_ahead([e.id for e in entries])
        assert fresh.load(bad.id) is None and fresh.corrupt == 1
        assert bad.id not in fresh and not fresh._path(bad.id).exists()
        assert fresh.load(gone.id) is None and gone.id not in fresh and fresh.corrupt == 1
        got = fresh.load(good.id)
        assert got is not None and same(got, good)
    finally:
        fresh.close()


def test_drop_and_close_cancel_the_reads_not_started(monkeypatch):
    """One worker: the first read runs (held on an event), the others wait; a drop
    cancels those, close waits for the running one, and no cancelled read ever runs."""
    started, release = threading.Event(), threading.Event()
    calls = []

    def gated(path, keep=True, into=None):
        calls.append(path.name)
        started.set()
        release.wait(60)
        return path.name

    monkeypatch.setattr(ssd_io, "read_file", gated)
    ahead = ssd_io.ReadAhead(workers=1)
    for key in "abc":
        ahead.start(key, Path(key), 8)
    assert started.wait(60)
    _, running = ahead.take("a")
    waiting = [ahead._reads[k][1] for k in "bc"]
    ahead.drop()
    assert all(read.cancelled() for read in waiting) and "b" not in ahead
    release.set()
    ahead.close()
    assert running.result() == "a" and calls == ["a"]


def test_a_file_replaced_after_its_verifying_read_is_not_loaded(tmp_path, load_mode):
    """Loaded by path, a file is read twice: a file swapped (a corrupt byte, a new inode)
    between the verifying read ahead and the load is refused and removed, never loaded;
    staged, the load views the verified bytes and the swap does not matter."""
    entries = written(tmp_path, 2)
    fresh = Tier(tmp_path, FP, 1 << 30)
    try:
        swapped, good = entries
        fresh.reader.read_ahead([swapped.id])
        _, read = fresh.reader.ahead._reads[swapped.id]
        read.result(60)  # verified
        path = fresh._path(swapped.id)
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0x10
        side = path.with_suffix(".swap")
        side.write_bytes(bytes(raw))
        side.rename(path)
        got = fresh.load(swapped.id)
        if load_mode:
            assert got is None and fresh.corrupt == 1 and not path.exists()
        else:
            assert got is not None and same(got, swapped) and fresh.corrupt == 0
        got = fresh.load(good.id)
        assert got is not None and same(got, good)
    finally:
        fresh.close()
