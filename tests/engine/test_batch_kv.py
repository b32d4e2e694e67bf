"""The batch K/V cache that joins in one copy (core/engine/batch_kv.py): the same rows,
mask and attention inputs as mlx-lm's ``BatchKVCache``, and a join that holds the old
rows and one copy (admission's model of a join, core/memory/admission.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache
from tierchat.core.engine.batch_kv import OneCopyBatchKVCache, place_rows, room
from tierchat.core.engine.quantized_batch import merge_of

HEADS, DIM = 2, 32


def _row(n: int, seed: int) -> KVCache:
    c = KVCache()
    if n:
        k = mx.random.normal((1, HEADS, n, DIM), key=mx.random.key(seed))
        c.update_and_fetch(k, 2 * k)
    return c


def _same_row(a: KVCache, b: KVCache) -> bool:
    if a.offset != b.offset:
        return False
    if a.offset == 0:
        return True
    n = a.offset
    same = [
        mx.array_equal(x[..., :n, :], y[..., :n, :])
        for x, y in ((a.keys, b.keys), (a.values, b.values))
    ]
    return all(bool(s) for s in same)


def _equal_batches(ours: BatchKVCache, theirs: BatchKVCache) -> None:
    """Same offsets, padding, K/V in every position a row reads, and mask."""
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    assert ours._idx == theirs._idx
    for x, y in zip(ours.keys_and_values(), theirs.keys_and_values(), strict=True):
        assert x.shape == y.shape and bool(mx.array_equal(x, y))
    assert bool(mx.array_equal(ours.make_mask(1), theirs.make_mask(1)))


def test_kv_caches_merge_into_the_one_copy_batch():
    assert merge_of(KVCache) == OneCopyBatchKVCache.merge


def test_merge_extend_filter_extract_equal_mlx_lm_and_give_each_row_back():
    """Rows of 5, 0 and 300 tokens merged, extended with rows of 17 and 1, then a decode
    step, a filter and extracts: the same K/V, padding and mask as mlx-lm's
    ``BatchKVCache`` at every stage, and each row's own K/V back, bit for bit."""
    rows = [_row(5, 1), _row(0, 2), _row(300, 3)]
    more = [_row(17, 4), _row(1, 5)]
    ours, theirs = OneCopyBatchKVCache.merge(rows), BatchKVCache.merge(rows)
    _equal_batches(ours, theirs)
    assert ours.keys.shape[2] == room(300, ours.step) == 512  # room for the next step
    assert all(_same_row(ours.extract(i), r) for i, r in enumerate(rows))
    ours.extend(OneCopyBatchKVCache.merge(more))
    theirs.extend(BatchKVCache.merge(more))
    _equal_batches(ours, theirs)
    rows += more
    assert all(_same_row(ours.extract(i), r) for i, r in enumerate(rows))
    # a decode step writes in place: no growth, and the same attention inputs
    step = mx.random.normal((5, HEADS, 1, DIM), key=mx.random.key(9))
    size = ours.keys.shape[2]
    got, want = ours.update_and_fetch(step, -step), theirs.update_and_fetch(step, -step)
    assert ours.keys.shape[2] == size
    assert all(bool(mx.array_equal(x, y)) for x, y in zip(got, want, strict=True))
    ours.filter([0, 3])
    theirs.filter([0, 3])
    _equal_batches(ours, theirs)


def test_extend_of_an_empty_side_keeps_the_rows_of_the_other():
    empty = OneCopyBatchKVCache.merge([_row(0, 1)])
    full = OneCopyBatchKVCache.merge([_row(7, 2), _row(3, 3)])
    empty.extend(full)
    assert empty.offset.tolist() == [0, 7, 3] and empty.left_padding.tolist() == [7, 0, 4]
    assert _same_row(empty.extract(1), _row(7, 2)) and _same_row(empty.extract(2), _row(3, 3))


def test_place_rows_refuses_a_part_past_the_end():
    like = mx.zeros((1, HEADS, 4, DIM))
    with pytest.raises(ValueError, match="does not fit"):
        place_rows([(like, 1)], 3, 8, like)
    with pytest.raises(ValueError, match="past the array"):
        place_rows([(like, 1)], 9, 8, like)


def _join_peak(cls: type, batch: int, n: int) -> tuple[int, int]:
    """(MLX peak above what was held, bytes of the joined batch's K/V) when one row of
    ``n`` tokens joins a batch of ``batch`` such rows and the next decode step runs."""
    main = cls.merge([_row(n, i) for i in range(batch)])
    joiner = cls.merge([_row(n, 99)])
    mx.eval(main.keys, main.values, joiner.keys, joiner.values)
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    main.extend(joiner)
    del joiner
    step = mx.zeros((batch + 1, HEADS, 1, DIM))
    mx.eval(main.update_and_fetch(step, step))
    mx.synchronize()
    return mx.get_peak_memory() - held, main.keys.nbytes + main.values.nbytes


def test_a_join_holds_the_old_rows_and_one_copy():
    """mlx-lm's join pads, concatenates, then grows the array at the next step (each a
    copy of the batch); ours writes each row once, with room for that step: the peak above
    what was held is at most the joined batch's K/V (what admission reserves)."""
    extra, batch_bytes = _join_peak(OneCopyBatchKVCache, 3, 700)
    assert extra <= 1.05 * batch_bytes, (extra, batch_bytes)
    theirs, _ = _join_peak(BatchKVCache, 3, 700)
    assert theirs > 1.3 * extra  # the test sees the difference it is about
