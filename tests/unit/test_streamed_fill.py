"""The streamed fill of an SSD restore (docs/DESIGN.md §9, core/cache/fill.py): K/V copied
into the cache's buffers entry by entry gives, bit for bit, the cache one concatenate per
array after the last load gives (:meth:`KVLeaf.restore`), plain and quantized K/V, with a
tail cut to its used tokens; out-of-order or incomplete fills are refused."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from tierchat.core.cache.blocks import KIND_BLOCK, Entry
from tierchat.core.cache.fill import StreamedFill
from tierchat.core.cache.layers import KVLeaf

BS = 16


def bits(a: mx.array) -> np.ndarray:
    view = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[a.dtype.size]
    return np.array(a.view(view))


def block(i: int, names: dict[str, tuple[tuple[int, ...], mx.Dtype]], n: int = BS) -> Entry:
    """An entry whose arrays are ``names`` (``"<leaf>.<part>"`` -> (shape without the token
    axis, dtype)) with ``n`` tokens on axis 2, seeded by ``i``."""
    arrays = {}
    for j, (name, ((b, h, d), dtype)) in enumerate(names.items()):
        x = mx.random.normal((b, h, n, d), key=mx.random.key(100 * i + j))
        arrays[name] = (x * 50).astype(dtype)
    mx.eval(list(arrays.values()))
    return Entry(
        id=f"{i:064x}",
        parent="0" * 64,
        kind=KIND_BLOCK,
        start=i * BS,
        tokens=tuple(range(n)),
        role="user",
        arrays=arrays,
    )


def parts_of(e: Entry, leaf: str, tokens: int) -> dict:
    p = f"{leaf}."
    return {k[len(p) :]: a[..., :tokens, :] for k, a in e.arrays.items() if k.startswith(p)}


PLAIN = {"0.k": ((1, 2, 8), mx.bfloat16), "0.v": ((1, 2, 8), mx.bfloat16)}
PLAIN |= {"1.k": ((1, 4, 4), mx.float32), "1.v": ((1, 4, 4), mx.float32)}
QUANT = {
    f"0.{p}{i}": ((1, 2, w), dt)
    for p in "kv"
    for i, (w, dt) in enumerate([(4, mx.uint32), (1, mx.float16), (1, mx.float16)])
}


@pytest.mark.parametrize(
    ("names", "leaves", "cls"),
    [(PLAIN, ("0", "1"), KVCache), (QUANT, ("0",), lambda: QuantizedKVCache(group_size=32))],
)
@pytest.mark.parametrize(("blocks", "tail_tokens"), [(3, 0), (3, 5), (1, 0), (0, 7), (17, 9)])
def test_streamed_fill_is_the_concatenated_restore(names, leaves, cls, blocks, tail_tokens):
    entries = [block(i, names) for i in range(blocks)]
    tail = block(99, names) if tail_tokens else None
    position = blocks * BS + tail_tokens
    adapters = [KVLeaf(name, "kv", "KVCache") for name in leaves]
    fill = StreamedFill(adapters, position, eval_bytes=1)  # an eval after every entry
    for e in entries:
        fill.add(e, BS)
    if tail is not None:
        assert not fill.complete
        fill.add(tail, tail_tokens)
    assert fill.complete
    for leaf in adapters:
        want, got = cls(), cls()
        parts = [parts_of(e, leaf.name, BS) for e in entries]
        parts += [parts_of(tail, leaf.name, tail_tokens)] if tail is not None else []
        leaf.restore(want, parts, position)
        fill.adopt(leaf, got)
        assert got.offset == want.offset == position
        flat = [
            (a, b)
            for x, y in ((got.keys, want.keys), (got.values, want.values))
            for a, b in zip(*((x, y) if isinstance(x, tuple) else ((x,), (y,))), strict=True)
        ]
        for a, b in flat:
            assert a.shape == b.shape and a.dtype == b.dtype
            assert a.shape[2] == KVLeaf.padded_length(position)
            assert np.array_equal(bits(a), bits(b))
    # the bytes a restore reports as copied: the K/V of the tokens used
    used = sum(a.nbytes for e in entries for a in e.arrays.values())
    if tail is not None:
        used += sum(a[..., :tail_tokens, :].nbytes for a in tail.arrays.values())
    assert fill.nbytes == used


def test_a_fill_past_its_position_or_incomplete_is_refused():
    leaf = KVLeaf("0", "kv", "KVCache")
    fill = StreamedFill([leaf], 2 * BS)
    fill.add(block(0, PLAIN), BS)
    with pytest.raises(ValueError, match="filled 16 of 32"):
        fill.adopt(leaf, KVCache())
    with pytest.raises(ValueError, match="past the restore position"):
        fill.add(block(1, PLAIN), 2 * BS)
    fill.add(block(1, PLAIN), BS)
    fill.adopt(leaf, KVCache())


def test_an_entry_without_a_leafs_arrays_is_refused():
    fill = StreamedFill([KVLeaf("2", "kv", "KVCache")], BS)
    with pytest.raises(ValueError, match="no arrays of leaf 2"):
        fill.add(block(0, PLAIN), BS)


def test_the_buffers_are_written_in_place():
    """Each copy lands in the buffer made at the first entry (MLX donates a slice update's
    input that nothing else holds): no buffer of the restore's size is made per entry."""
    leaf = KVLeaf("0", "kv", "KVCache")
    fill = StreamedFill([leaf], 4 * BS, eval_bytes=1)
    fill.add(block(0, PLAIN), BS)
    where = {
        n: np.frombuffer(memoryview(a), np.uint8).ctypes.data for n, a in fill.buffers["0"].items()
    }
    for i in range(1, 4):
        fill.add(block(i, PLAIN), BS)
    for n, a in fill.buffers["0"].items():
        assert np.frombuffer(memoryview(a), np.uint8).ctypes.data == where[n]


def test_room_for_the_rest_of_the_prompt_takes_its_prefill_in_place():
    """Buffers made for the whole prompt: the prefill of its rest writes into them (no
    KVCache growth, which concatenates the whole buffer), and the cache then holds what a
    restore by concatenate followed by the same update holds."""
    leaf = KVLeaf("0", "kv", "KVCache")
    entries = [block(i, PLAIN) for i in range(2)]
    rest = 300  # over KVLeaf.restore's padding: a concatenated restore grows for it
    fill = StreamedFill([leaf], 2 * BS, length=2 * BS + rest + 1)
    for e in entries:
        fill.add(e, BS)
    got, want = KVCache(), KVCache()
    fill.adopt(leaf, got)
    leaf.restore(want, [parts_of(e, "0", BS) for e in entries], 2 * BS)
    assert got.keys.shape[2] == KVLeaf.padded_length(2 * BS + rest + 1) > want.keys.shape[2]
    mx.eval(got.keys, got.values)
    where = np.frombuffer(memoryview(got.keys), np.uint8).ctypes.data
    chunk = block(7, PLAIN, n=rest)
    k, v = chunk.arrays["0.k"], chunk.arrays["0.v"]
    outs = [c.update_and_fetch(k, v) for c in (got, want)]
    mx.eval(outs)
    assert np.frombuffer(memoryview(got.keys), np.uint8).ctypes.data == where  # in place
    for a, b in zip(outs[0], outs[1], strict=True):
        assert a.shape == b.shape == (1, 2, 2 * BS + rest, 8)
        assert np.array_equal(bits(a), bits(b))
