"""``kv_bits`` sequences decode in one merged batch (core/engine/quantized_batch.py,
docs/DESIGN.md §20 item 5): each row's tokens and logprobs equal the same sequence decoded
alone on its own ``QuantizedKVCache`` (quantized against quantized: quantization itself
moves the logits away from full precision), and the cache extracted after the batch is
the alone-run's. Tiny models on the CPU in float32.

mlx's ``quantize`` takes groups of 32, 64 or 128 values, and most tiny models have
16-value heads; those run here as a variant with 32-value heads (:func:`_kv_tiny`), the
same architecture and cache classes otherwise."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from engine_kit import generate, make_engine, random_prompt
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, make_prompt_cache
from tierchat.core.api import Finished, GenerateRequest
from tierchat.core.engine.decode_batch import DecodeBatch
from tierchat.core.engine.quantized_batch import BatchQuantizedKVCache
from tierchat.core.models.loading import load_model
from tierchat.core.models.tiny import materialize_tiny, tiny_config
from tierchat.core.sampling_params import SamplingParams

GROUP, BITS = 32, 8
KV_BITS_TOL = 1e-3  # logprobs with quantized KV (see the module doc)
# every tiny architecture with attention layers (mamba2 has none to quantize)
KV_ARCHS = ["llama", "qwen2", "gemma3", "llama_sliding", "qwen3_next", "qwen3_5"]
KV_ARCHS += ["falcon_h1", "baichuan_m1"]


def _kv_tiny(arch: str, models_dir) -> str:
    """A model spec of ``tiny:<arch>`` whose attention heads quantize (32 values): the
    tiny model itself for llama, else a seeded variant with 32-value heads under
    ``models_dir``."""
    if arch == "llama":
        return "tiny:llama"
    from mlx_lm.utils import _get_classes

    target = models_dir / f"tiny-{arch}-kv32"
    if (target / "model.safetensors").exists():
        return str(target)
    config = tiny_config(arch)
    text = config.get("text_config", config)
    text["head_dim"] = 32
    if "query_pre_attn_scalar" in text:
        text["query_pre_attn_scalar"] = 32
    if arch in ("qwen2", "baichuan_m1"):  # head size = hidden size / heads
        text["hidden_size"] = 128
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(7)
    model = model_cls(args_cls.from_dict(config))
    tmp = models_dir / f".tiny-{arch}-kv32.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config))
    source = materialize_tiny(arch, models_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp / name)
    try:
        tmp.rename(target)
    except OSError:  # another worker published it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _quantized(model) -> list:
    """A fresh cache list with every plain KV layer quantized, as ``kv_bits`` makes it
    (``core/engine/runtime.py`` ``cache_factory``)."""

    def q(c):
        if type(c) is KVCache:
            return QuantizedKVCache(group_size=GROUP, bits=BITS)
        if isinstance(c, CacheList):
            c.caches = tuple(q(x) for x in c.caches)
        return c

    return [q(c) for c in make_prompt_cache(model)]


def _filled(model, tokens) -> list:
    cache = _quantized(model)
    model(mx.array([list(tokens)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _leaves(caches):
    for c in caches:
        if isinstance(c, CacheList):
            yield from _leaves(c.caches)
        else:
            yield c


def _next_logprobs(model, caches, token) -> np.ndarray:
    logits = model(mx.array([[token]]), cache=caches)[:, -1, :].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]


def _decode(batch: DecodeBatch, joins: dict[int, list], removed: dict[int, int]):
    """Step ``batch`` until every sequence ends; ``joins``: step -> (uid, token, caches,
    context) added before it; ``removed``: uid -> the step before which it is removed.
    Returns uid -> (tokens, logprobs, caches)."""
    out: dict[int, tuple[list, list, list | None]] = {}
    step = 0
    while joins or len(batch):
        for uid, token, caches, context in joins.pop(step, []):
            batch.add(uid, token, caches, context, 6, [])
            out[uid] = ([], [], None)
        for uid, at in removed.items():
            if at == step:
                toks, lps, _ = out[uid]
                out[uid] = (toks, lps, batch.remove(uid))
        for s in batch.step():
            toks, lps, _ = out[s.uid]
            toks.append(s.token)
            lps.append(np.array(s.logprobs))
            out[s.uid] = (toks, lps, s.caches)
        step += 1
    return out


@pytest.mark.parametrize("arch", KV_ARCHS)
def test_quantized_rows_batch_and_equal_each_sequence_alone(arch, models_dir):
    """Four ``kv_bits`` sequences (9 to 40 tokens; two join at the third step, one leaves
    at the fifth) decode in one merged batch; each row's tokens equal the sequence decoded
    alone, its logprobs within 1e-3, and the cache it leaves with is the alone-run's (as
    many tokens, the same format, each value within one quantization step; the same next
    logprobs)."""
    model = load_model(_kv_tiny(arch, models_dir), models_dir=models_dir).model
    prompts = [random_prompt(n, seed=s) for n, s in ((21, 1), (9, 2), (40, 3), (30, 4))]

    def join(i):
        p = prompts[i]
        return (i, p[-1], _filled(model, p[:-1]), list(p[:-1]))

    removed = {3: 5}  # uid 3 leaves before step 5 (the batch filters its row out)
    alone = {}
    for i in range(4):
        cut = {i: removed[i] - 2} if i in removed else {}  # the same tokens fed
        alone.update(_decode(DecodeBatch(model), {0: [join(i)]}, cut))
    batch = DecodeBatch(model)
    got = _decode(batch, {0: [join(0), join(1)], 2: [join(2), join(3)]}, removed)
    assert batch.peak_merged == 4  # one merged batch, not one-row batches
    probe = random_prompt(1, seed=9)[0]
    for i in range(4):
        (a_toks, a_lps, a_cache), (b_toks, b_lps, b_cache) = alone[i], got[i]
        assert b_toks == a_toks
        assert len(a_lps) == len(b_lps) > 0
        for x, y in zip(a_lps, b_lps, strict=True):
            assert float(np.abs(x - y).max()) < KV_BITS_TOL
        quantized = 0
        for x, y in zip(_leaves(a_cache), _leaves(b_cache), strict=True):
            assert type(x) is type(y)
            if isinstance(x, QuantizedKVCache):
                quantized += 1
                assert y.offset == x.offset and (y.bits, y.group_size) == (BITS, GROUP)
                for u, v in zip(x.keys_and_values(), y.keys_and_values(), strict=True):
                    assert [a.shape for a in u] == [b.shape for b in v]
                    step = float(u[1].max())  # the largest scale: one quantization step
                    gap = mx.abs(_dequantized(u) - _dequantized(v)).max()
                    assert float(gap) <= step * 1.01 + 1e-5
        assert quantized > 0
        after_a = _next_logprobs(model, a_cache, probe)
        after_b = _next_logprobs(model, b_cache, probe)
        assert float(np.abs(after_a - after_b).max()) < KV_BITS_TOL


def _dequantized(triple) -> mx.array:
    return mx.dequantize(*triple, group_size=GROUP, bits=BITS)


def _one_row(n: int, seed: int, dim: int = 32) -> QuantizedKVCache:
    c = QuantizedKVCache(group_size=GROUP, bits=BITS)
    if n:
        k = mx.random.normal((1, 2, n, dim), key=mx.random.key(seed))
        c.update_and_fetch(k, -k)
    return c


def _same(a: QuantizedKVCache, b: QuantizedKVCache) -> bool:
    if a.offset != b.offset:
        return False
    if a.offset == 0:
        return True
    pairs = zip(tree_flatten(a.keys_and_values()), tree_flatten(b.keys_and_values()), strict=True)
    return all(bool(mx.array_equal(x[1], y[1])) for x, y in pairs)


def test_merge_extend_filter_extract_give_each_row_back():
    """The batch cache's bookkeeping alone: rows of 5, 0 and 300 tokens (one past the
    first 256-token step) merged, extended with rows of 17 and 1, filtered, and extracted
    give each row's own quantized K/V back, bit for bit; a row's mask hides its padding."""
    rows = [_one_row(5, 1), _one_row(0, 2), _one_row(300, 3)]
    batch = BatchQuantizedKVCache.merge(rows)
    assert batch.size() == 300 and batch.offset.tolist() == [5, 0, 300]
    assert all(_same(batch.extract(i), r) for i, r in enumerate(rows))
    more = [_one_row(17, 4), _one_row(1, 5)]
    batch.extend(BatchQuantizedKVCache.merge(more))
    rows += more
    assert all(_same(batch.extract(i), r) for i, r in enumerate(rows))
    mask = batch.make_mask(1)  # (B, 1, 1, S + 1): row 0 sees its 5 tokens and the new one
    assert mask.shape == (5, 1, 1, 301)
    assert int(mask[0].sum()) == 6 and int(mask[1].sum()) == 1 and bool(mask[2].all())
    batch.filter([0, 3])  # the 300-token row leaves: the padding no kept row needs goes
    assert batch.size() == 17 and batch.left_padding.tolist() == [12, 0]
    assert _same(batch.extract(0), rows[0]) and _same(batch.extract(1), rows[3])
    with pytest.raises(ValueError, match="several formats"):
        BatchQuantizedKVCache.merge([_one_row(3, 1), QuantizedKVCache(group_size=64, bits=4)])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kv_bits_requests_merge_on_the_engine_and_store_what_alone_stores(
    arch, tmp_path, models_dir
):
    """On the engine with ``kv_bits``: three requests decode in one merged batch, each
    reply equal to the same request alone on a cold engine with ``kv_bits`` (tokens; the
    logprobs of the first tokens within 1e-3), and each prompt again restores what the
    batch stored, with the alone-run's tokens."""
    from test_scheduler import Hold, _prompts

    spec = _kv_tiny(arch, models_dir)
    kw = dict(prefill_chunk=32, prefill_step=16, kv_bits=BITS, kv_group_size=GROUP)
    cold = make_engine(spec, tmp_path / "cold", models_dir, no_cache=True, **kw)
    hot = make_engine(spec, tmp_path / "hot", models_dir, **kw)
    try:
        cold.record_logprobs = hot.record_logprobs = 6
        prompts = _prompts()[:3]
        alone = [generate(cold, p, max_tokens=6) for p in prompts]
        hold = Hold(hot)
        handles = [
            hot.submit(GenerateRequest(sampling=SamplingParams(max_tokens=6), prompt_ids=p))
            for p in prompts
        ]
        hold.release()
        results = [h.wait(300) for h in handles]
        assert all(isinstance(r, Finished) for r in results), results
        _assert_replies_close(alone, results, handles)
        assert hot.executor.batch.peak_merged == 3  # one merged batch
        for p, (a, _) in zip(prompts, alone, strict=True):
            again, h = generate(hot, p, max_tokens=6)
            assert again.token_ids == a.token_ids
            assert h.trace.restored_position > 0
    finally:
        cold.close()
        hot.close()


def _assert_replies_close(alone, results, handles) -> None:
    for (a, ha), b, hb in zip(alone, results, handles, strict=True):
        assert b.token_ids == a.token_ids
        assert len(ha.trace.logprobs) == len(hb.trace.logprobs) > 0
        for x, y in zip(ha.trace.logprobs, hb.trace.logprobs, strict=True):
            assert float(np.abs(x - y).max()) < KV_BITS_TOL


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_kv_bits_rests_prefill_in_one_group_and_equal_each_alone(arch, tmp_path, models_dir):
    """With ``kv_bits``, five requests with one new system prompt arrive together: the
    first computes it, the others restore it and their rests go through one forward
    (quantized caches merged, on an attention model and a hybrid); each reply equals the
    request alone on a cold engine with ``kv_bits`` (tokens; logprobs within 1e-3), and
    what they stored restores with the same tokens."""
    from engine_kit import still_clock
    from test_prefill_batch import SYSTEM, _requests, _run_together

    spec = _kv_tiny(arch, models_dir)
    kw = dict(prefill_chunk=256, bitwise=False, kv_bits=BITS, kv_group_size=GROUP)
    cold = make_engine(spec, tmp_path / "cold", models_dir, no_cache=True, **kw)
    hot = make_engine(
        spec, tmp_path / "hot", models_dir, clock=still_clock, choose_recompute=False, **kw
    )
    try:
        cold.record_logprobs = hot.record_logprobs = 6
        reqs = _requests()
        opts = [{k: v for k, v in r.items() if k != "prompt_ids"} for r in reqs]
        alone = [generate(cold, r["prompt_ids"], **o) for r, o in zip(reqs, opts, strict=True)]
        results, handles = _run_together(hot, reqs)
        assert hot.executor.peak_group == len(reqs) - 1  # the rests in one forward
        assert hot.executor.batch.peak_merged >= 2
        _assert_replies_close(alone, results, handles)
        for r, o, (a, _) in zip(reqs, opts, alone, strict=True):
            again, h = generate(hot, r["prompt_ids"], **o)
            assert again.token_ids == a.token_ids
            assert h.trace.restored_position > SYSTEM
    finally:
        cold.close()
        hot.close()


def test_a_group_size_the_heads_do_not_divide_fails_at_load_with_a_clear_message(
    tmp_path, models_dir
):
    from tierchat.config.settings import Settings
    from tierchat.core.engine.engine import Engine

    # tiny:qwen2 has 16-value heads: no group of mlx's quantize divides them
    engine = Engine(
        Settings(
            models_dir=models_dir,
            cache_dir=tmp_path / "kv",
            data_dir=tmp_path / "data",
            kv_bits=BITS,
            kv_group_size=64,
        )
    )
    try:
        for spec, fits in (("tiny:llama", "kv_group_size = 32"), ("tiny:qwen2", "no kv_bits")):
            got = engine.load_model(spec).wait(120)
            message = getattr(got, "message", "")
            assert "in groups of 64 values" in message and fits in message, message
        assert engine.loaded is None  # nothing half-loaded
    finally:
        engine.close()
    # a group the heads divide loads (tiny:llama: 32-value heads)
    ok = make_engine("tiny:llama", tmp_path / "ok", models_dir, kv_bits=BITS, kv_group_size=32)
    ok.close()
