"""The SSD tier on its own: round trips (bf16 included), index rebuild, LRU cap,
permissions, pending entries served from memory, backpressure, the file format."""

from __future__ import annotations

import stat
import threading

import mlx.core as mx
import numpy as np
import pytest
from ssd_kit import FP, entry
from tierchat.core.cache.blocks import KIND_BLOCK, KIND_TAIL, root_id
from tierchat.core.cache.ssd import format as ssd_format
from tierchat.core.cache.ssd import io as ssd_io
from tierchat.core.cache.ssd.format import CorruptEntry
from tierchat.core.cache.ssd.reader import SSDReader
from tierchat.core.cache.ssd.tier import SSDTier

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def bits(a: mx.array) -> np.ndarray:
    """The array's raw bits (bf16 included), for bitwise comparison."""
    view = {2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    return np.array(a.view(view) if a.dtype != mx.bool_ else a)


def assert_bitwise(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, a in want.items():
        b = got[name]
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert np.array_equal(bits(a), bits(b)), name


@pytest.fixture(params=[False, True], ids=["staged", "by-path"])
def tier(tmp_path, request, monkeypatch):
    """Make SSD tiers in ``tmp_path``; each test runs with both ways a file is loaded
    (viewed in its staging arrays; verified, then ``mx.load``-ed as on CUDA)."""
    monkeypatch.setattr(SSDReader, "by_path", request.param)
    made = []

    def make(**kw):
        t = SSDTier(tmp_path, FP, kw.pop("max_bytes", 1 << 30), **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd_restore_equals_hot_bit_for_bit(tier, dtype):
    """Issue 11 part 2: the same entry restores the same arrays from either tier."""
    ssd = tier()
    hot = [entry(i, dtype) for i in range(3)]
    for e in hot:
        assert ssd.put(e)
        got = ssd.load(e.id)  # still pending or already written: either way the same
        assert_bitwise(got.arrays, e.arrays)
    ssd.flush()
    fresh = tier()  # a restart: the index rebuilt from headers, arrays read from files
    for e in hot:
        got = fresh.load(e.id)
        assert got is not None and got.tokens == e.tokens and got.kind == KIND_BLOCK
        assert_bitwise(got.arrays, e.arrays)
    assert fresh.corrupt == 0 and fresh.memory_hits == 0 and fresh.hits == 3
    path = fresh._path(hot[0].id)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_a_batch_writes_each_entry_once_from_its_own_copy_and_reports_idle(tier):
    ssd = tier()
    idle = threading.Event()
    ssd.on_idle = idle.set
    mixed = [entry(i, dtype) for i, dtype in enumerate(DTYPES)]
    a, b = entry(7), entry(7)
    b.window = False  # the same id with fewer parts: the batch keeps a
    assert ssd.put_many([*mixed, b, a]) == [True, True, True, False, True]
    # one piece per small entry (none left once written)
    assert all(len(p.pieces) == 1 for p in ssd.writer.pending.values() if p.pieces)
    assert ssd.flush() and idle.wait(5)
    assert ssd.saves_persisted == 4 and ssd.meta(a.id).window
    fresh = tier()
    for e in [*mixed, a]:
        assert_bitwise(fresh.load(e.id).arrays, e.arrays)


def test_copy_pieces_are_the_bytes_in_order_and_never_the_input():
    a = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    b = mx.array([1.5, -2.0], dtype=mx.bfloat16)
    (flat,) = ssd_io.copy_pieces([a, b])
    assert flat.dtype == mx.uint8 and flat.size == a.nbytes + b.nbytes
    assert bytes(np.array(flat)) == np.array(a).tobytes() + bits(b).tobytes()
    (lone,) = ssd_io.copy_pieces([a])
    mx.eval(lone)
    assert bytes(np.array(lone)) == np.array(a).tobytes()

    def address(x):
        return np.frombuffer(memoryview(x).cast("B"), np.uint8).ctypes.data

    view = a.reshape(-1).view(mx.uint8)  # what concatenate alone would hand back
    assert address(view) == address(a) and address(lone) != address(a)


def test_files_open_in_other_tools(tier):
    ssd = tier()
    e = entry(1, mx.bfloat16)
    ssd.put(e)
    ssd.flush()
    loaded = mx.load(str(ssd._path(e.id)))  # MLX's own safetensors reader
    assert_bitwise(loaded, e.arrays)
    from safetensors import safe_open

    f32 = entry(2)
    ssd.put(f32)
    ssd.flush()
    with safe_open(str(ssd._path(f32.id)), framework="numpy") as f:
        assert f.metadata()["format"] == ssd_format.FORMAT
        assert np.array_equal(f.get_tensor("0.k"), np.array(f32.arrays["0.k"]))


def test_pending_entry_is_visible_and_served_from_memory(tier):
    ssd = tier()
    ssd.writer.write_delay_s = 0.3
    e = entry(1, mx.bfloat16)
    assert ssd.put(e)
    # visible at once, whatever the writer has done
    assert e.id in ssd and ssd.meta(e.id) is not None
    assert [m.id for m in ssd.children_of(e.parent)] == [e.id]
    assert ssd.queue_depth == 1
    got = ssd.load(e.id)
    assert ssd.memory_hits == 1
    assert_bitwise(got.arrays, e.arrays)
    assert not ssd.put(e)  # already held
    ssd.flush()
    assert ssd.queue_depth == 0 and ssd.saves_persisted == 1
    assert_bitwise(ssd.load(e.id).arrays, e.arrays)


def test_backpressure_blocks_instead_of_dropping(tier):
    ssd = tier(queue_size=2)
    ssd.writer.write_delay_s = 0.05
    es = [entry(i) for i in range(8)]
    for e in es:
        assert ssd.put(e)
        assert ssd.queue_depth <= 2
    assert ssd.write_drops == 0 and ssd.backpressure_waits > 0
    assert all(e.id in ssd for e in es)
    ssd.flush()
    assert ssd.saves_persisted == ssd.saves_queued == 8


def test_holds_keep_the_writer_until_every_holder_resumes(tier):
    """Two holders (two requests before their first token, or a request and the engine
    while it decodes): the writer writes nothing until both have resumed (docs/DESIGN.md
    §8.6). The queue is observed, never timed: entries held stay pending."""
    ssd = tier()
    ssd.pause("a")
    ssd.pause("b")
    es = [entry(i) for i in range(3)]
    for e in es:
        assert ssd.put(e)
    assert ssd.held
    ssd.resume("a")
    assert ssd.held and ssd.saves_persisted == 0
    assert ssd.queue_depth == 3
    ssd.resume("a")  # resuming twice is harmless; "b" still holds
    assert ssd.held
    ssd.resume("b")
    assert not ssd.held
    assert ssd.flush(30)
    assert ssd.saves_persisted == 3


def test_flush_and_backpressure_write_through_a_hold(tier):
    """A hold never blocks a flush (close, a clear) or the engine thread: backpressure
    lets the writer run until its queue empties, then the hold applies again."""
    ssd = tier(queue_size=2)
    ssd.pause("engine")
    for i in range(6):  # the third put finds the queue full: backpressure, not a hang
        assert ssd.put(entry(i))
    assert ssd.write_drops == 0 and ssd.backpressure_waits > 0
    assert ssd.flush(30)
    assert ssd.saves_persisted == 6
    assert ssd.held  # the hold outlives the flush
    assert ssd.put(entry(9))
    assert ssd.saves_persisted == 6
    assert ssd.flush(30) and ssd.saves_persisted == 7


def test_backpressure_by_bytes(tier):
    one = entry(0)
    ssd = tier(max_pending_bytes=one.nbytes * 2)
    ssd.writer.write_delay_s = 0.05
    for i in range(5):
        assert ssd.put(entry(i))
        assert ssd.pending_bytes <= one.nbytes * 2 + 4096
    assert ssd.write_drops == 0


def test_index_rebuilt_from_headers(tier):
    ssd = tier()
    a, t = entry(1), entry(2, kind=KIND_TAIL)
    ssd.put(a)
    ssd.put(t)
    ssd.close()
    again = tier()
    assert len(again) == 2 and again.nbytes == ssd.nbytes > 0
    assert {m.id for m in again.children_of(root_id(FP))} == {a.id, t.id}
    assert again.tail_ids() == [t.id]
    again.wait_verified()
    assert again.corrupt == 0


def test_cap_evicts_least_recently_used_at_put(tier, tmp_path):
    probe = SSDTier(tmp_path / "probe", FP, 1 << 30)
    probe.put(entry(0))
    probe.close()
    one = probe.nbytes
    ssd = tier(max_bytes=2 * one + one // 2)  # room for two entries
    ssd.writer.write_delay_s = 0.2  # eviction does not wait for the writer
    e1, e2, e3 = entry(1), entry(2), entry(3)
    ssd.put(e1)
    ssd.put(e2)
    assert ssd.load(e1.id) is not None  # e1 is now more recent than e2
    ssd.put(e3)
    assert e1.id in ssd and e3.id in ssd and e2.id not in ssd
    assert ssd.evictions == 1 and ssd.nbytes <= ssd.max_bytes
    ssd.flush()
    assert not ssd._path(e2.id).exists()


def test_cap_evicts_chains_from_their_ends_least_recent_chain_first(tier, tmp_path):
    """Two chains a0 <- a1 <- a2 and b0 <- b1 <- b2, written in that order (so the roots
    are the least recently used entries): the cap evicts a2, a1, a0 before any b block,
    and never a block whose descendants stay (a restore walks from the root)."""
    probe = SSDTier(tmp_path / "probe", FP, 1 << 30)
    probe.put(entry(0))
    probe.close()
    one = probe.nbytes
    ssd = tier(max_bytes=6 * one + one // 2)  # room for six entries
    chains = []
    for first in (0, 10):
        parent, chain = None, []
        for i in range(first, first + 3):
            chain.append(entry(i, parent=parent))
            parent = chain[-1].id
        chains.append(chain)
        ssd.put_many(chain)
    a, b = chains
    assert ssd.evictions == 0
    a_bytes = sum(ssd.meta(x.id).nbytes for x in a)
    c = entry(20)  # a third chain: one eviction, the end of the least recent chain
    ssd.put(c)
    assert a[2].id not in ssd and {a[0].id, a[1].id} <= set(ssd._index)
    c1 = entry(21, parent=c.id)
    ssd.put(c1)
    ssd.put(entry(22, parent=c1.id))
    kept = set(ssd._index)
    assert not {a[0].id, a[1].id, a[2].id} & kept and {x.id for x in b} <= kept
    for meta in ssd._index.values():  # every entry kept is reachable from the root
        assert meta.parent == root_id(FP) or meta.parent in kept
    assert ssd.evictions == 3 and ssd.evicted_bytes == a_bytes


def test_a_chain_longer_than_the_cap_keeps_its_root_most_blocks(tier, tmp_path):
    """One chain of six blocks under a cap of three and a half, written in order (as the
    close flush writes a conversation): the first three stay, reachable from the root; the
    fourth would evict its own parent and the later ones hang from it, so none is written
    (``cap_skips``) and nothing of the chain is evicted. An entry whose parent is not on the
    tier evicts nothing when over the cap; another chain that fits takes the first chain's
    end, never its head."""
    probe = SSDTier(tmp_path / "probe", FP, 1 << 30)
    probe.put(entry(0))
    probe.close()
    one = probe.nbytes
    ssd = tier(max_bytes=3 * one + one // 2)
    parent, chain = None, []
    for i in range(6):
        chain.append(entry(i, parent=parent))
        parent = chain[-1].id
    assert ssd.put_many(chain) == [True] * 3 + [False] * 3
    assert set(ssd._index) == {x.id for x in chain[:3]}
    assert ssd.cap_skips == 3 and ssd.evictions == 0
    orphan = entry(30, parent="cd" * 32)
    assert not ssd.put(orphan) and set(ssd._index) == {x.id for x in chain[:3]}
    other = entry(40)  # another chain that fits: evicts the end of the first
    assert ssd.put(other)
    assert set(ssd._index) == {chain[0].id, chain[1].id, other.id} and ssd.evictions == 1


def test_shape_mismatch_is_a_miss_and_removes_the_file(tier):
    ssd = tier()
    e = entry(1)
    ssd.put(e)
    ssd.flush()
    wrong = {"0.k": ((1, 4, -1, 8), mx.float32), "0.v": ((1, 4, -1, 8), mx.float32)}
    assert ssd.load(e.id, expected=wrong) is None
    assert ssd.corrupt == 1 and e.id not in ssd and not ssd._path(e.id).exists()


def test_clear_removes_every_file_pending_included(tier):
    ssd = tier()
    ssd.writer.write_delay_s = 0.05
    for i in range(3):
        ssd.put(entry(i))
    assert ssd.clear() == 3
    assert len(ssd) == 0 and ssd.nbytes == 0 and ssd.queue_depth == 0
    ssd.writer.write_delay_s = 0
    ssd.put(entry(9))
    ssd.flush()
    threading.Event().wait(0.2)  # let an abandoned in-flight write finish
    assert [p.name for p in ssd.dir.glob("*/*")] == [f"{entry(9).id}.safetensors"]


def test_every_byte_is_covered(tier):
    """A one-bit flip anywhere in a file (header, padding, data) fails verification."""
    ssd = tier()
    e = entry(1, mx.bfloat16, n=2)
    ssd.put(e)
    ssd.flush()
    path = ssd._path(e.id)
    good = path.read_bytes()
    ssd_io.read_file(path)  # the healthy file passes
    for pos in range(len(good)):
        bad = bytearray(good)
        bad[pos] ^= 1 << (pos % 8)
        path.write_bytes(bad)
        with pytest.raises(CorruptEntry):
            layout, _, _ = ssd_io.read_file(path)
            ssd_format.entry_meta(layout.meta, FP)


def test_tokens_must_hash_to_the_id(tmp_path):
    e = entry(1)
    meta = ssd_format._meta_strings(e, FP)
    meta["tokens"] = "[" + ",".join(str(t) for t in (*e.tokens[:-1], 7)) + "]"
    with pytest.raises(CorruptEntry, match="hash"):
        ssd_format.entry_meta(meta, FP)
    with pytest.raises(CorruptEntry, match="another model"):
        ssd_format.entry_meta(ssd_format._meta_strings(e, FP), "cd" * 32)
