"""Requests arriving together (docs/DESIGN.md §20): the ones that share a prefix another
request is computing wait for it and restore it, and their rests go through the model in
one forward (attention and state layers; windows and cache lists one by one); every reply equals the same request alone on a cold
engine (tokens equal, logprobs within 1e-4, float32 on the CPU). Deterministic: the engine
is held while the requests queue, so they are admitted together."""

from __future__ import annotations

import pytest
from engine_kit import generate, make_engine, random_prompt, still_clock
from engine_kit import request as make_request
from test_scheduler import Hold, _assert_close
from tierchat.core.api import Finished, GenerateRequest
from tierchat.core.models.tiny import TINY_ARCHS
from tierchat.core.sampling_params import SamplingParams

SYSTEM = 100  # the shared system prompt's tokens
KV_ONLY = ("llama", "qwen2")  # every layer a plain KVCache
GROUPED = (*KV_ONLY, "qwen3_5", "qwen3_next", "mamba2")  # + state layers: their rests group


def _requests() -> list[dict]:
    system = random_prompt(SYSTEM, seed=11, vocab=250)
    reqs = [
        dict(
            prompt_ids=system + random_prompt(9 + 7 * i, seed=i, vocab=250),
            max_tokens=6,
            boundaries=((SYSTEM, "system"),),
        )
        for i in range(5)
    ]
    reqs[2]["repetition_penalty"] = 1.8  # first token from the processed logits
    return reqs


def _run_together(engine, reqs: list[dict]):
    hold = Hold(engine)
    handles = [engine.submit(make_request(**r)) for r in reqs]
    hold.release()
    results = [h.wait(300) for h in handles]
    assert all(isinstance(r, Finished) for r in results), results
    return results, handles


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_requests_arriving_together_equal_each_alone(arch, tmp_path, models_dir):
    """Five requests with one new system prompt arrive together: the first computes it,
    the others wait and restore it (with state layers: at its boundary checkpoint); on
    attention and state models their rests (lengths 16 to 37) go through one forward. Each
    reply equals the request alone on a cold engine, and what they stored restores. The
    scheduler's clock stands still (no measured cost, no kept rate): the group's size
    follows from the requests and the chunk alone, however loaded the machine is (the
    sizing by measured cost is tests/unit/test_schedule_policy.py's)."""
    kw = dict(prefill_chunk=256, bitwise=False)
    cold = make_engine(f"tiny:{arch}", tmp_path / "cold", models_dir, no_cache=True, **kw)
    hot = make_engine(
        f"tiny:{arch}",
        tmp_path / "hot",
        models_dir,
        clock=still_clock,
        choose_recompute=False,
        **kw,
    )
    try:
        cold.record_logprobs = hot.record_logprobs = 6
        reqs = _requests()
        opts = [{k: v for k, v in r.items() if k != "prompt_ids"} for r in reqs]
        alone = [generate(cold, r["prompt_ids"], **o) for r, o in zip(reqs, opts, strict=True)]
        results, handles = _run_together(hot, reqs)
        assert results[0].metrics.cached_tokens == 0
        for r in results[1:]:  # they waited for the first and restored its system prompt
            assert r.metrics.cached_tokens >= SYSTEM - hot.cache.block_size, r.metrics
        if arch in GROUPED:
            assert hot.executor.peak_group == len(reqs) - 1  # the rests in one forward
        for (a, ha), b, hb in zip(alone, results, handles, strict=True):
            _assert_close(a, ha, b, hb)
        for r, o, (a, _) in zip(reqs, opts, alone, strict=True):
            again, h = generate(hot, r["prompt_ids"], **o)
            assert again.token_ids == a.token_ids
            assert h.trace.restored_position > SYSTEM
    finally:
        cold.close()
        hot.close()


@pytest.mark.parametrize("arch", KV_ONLY)
def test_a_group_of_folded_and_unfolded_rests_equals_each_alone(arch, tmp_path, models_dir):
    """With the folded last chunk limited to 20 tokens, longer rests end at N - 1 (the
    last token goes through the first decode step) and shorter ones give the first
    token's logits: one group holds both kinds, and each reply equals the request alone."""
    kw = dict(prefill_chunk=256, bitwise=False)
    cold = make_engine(f"tiny:{arch}", tmp_path / "cold", models_dir, no_cache=True, **kw)
    hot = make_engine(f"tiny:{arch}", tmp_path / "hot", models_dir, **kw)
    try:
        for e in (cold, hot):
            e.record_logprobs = 6
            e.runtime = e.runtime.with_plan(fold_limit=20)  # the CPU's limit on a folded chunk, made small
        reqs = _requests()
        for r in reqs:
            r.pop("repetition_penalty", None)
        alone = [generate(cold, r["prompt_ids"], max_tokens=6) for r in reqs]
        generate(hot, reqs[0]["prompt_ids"][:SYSTEM] + (5, 5), max_tokens=1)  # cached
        results, handles = _run_together(hot, reqs)
        assert hot.executor.peak_group == len(reqs)
        ends = {h.trace.chunk_ends[-1] - len(r["prompt_ids"]) for h, r in zip(handles, reqs, strict=True)}
        assert ends == {0, -1}  # folded rests and rests ending at N - 1, in one group
        for (a, ha), b, hb in zip(alone, results, handles, strict=True):
            _assert_close(a, ha, b, hb)
    finally:
        cold.close()
        hot.close()


def test_a_request_waits_only_when_waiting_saves_work(tmp_path, models_dir):
    """A queued request waits for a prefill in progress only when that prefill will store
    at least a block it lacks and has at most twice that much left to compute: behind a
    180-token rest, a request sharing the 100-token system prompt waits and restores it,
    one sharing 20 tokens or nothing starts at once; behind a 500-token rest, a request
    sharing the system prompt starts at once too (prefilled beside it)."""
    hot = make_engine("tiny:llama", tmp_path, models_dir, prefill_chunk=256, bitwise=False)
    try:
        system = random_prompt(SYSTEM, seed=11, vocab=250)
        prompts = (
            system + random_prompt(80, seed=1, vocab=250),
            random_prompt(8, seed=3, vocab=250),  # shares nothing
            system[:20] + random_prompt(30, seed=2, vocab=250),  # shares 20 tokens
            system + random_prompt(12, seed=4, vocab=250),  # shares the system prompt
        )
        results, _ = _run_together(hot, [dict(prompt_ids=p, max_tokens=2) for p in prompts])
        assert [r.metrics.cached_tokens for r in results[1:3]] == [0, 0]
        assert results[3].metrics.cached_tokens >= SYSTEM - hot.cache.block_size
        system = random_prompt(SYSTEM, seed=12, vocab=250)
        prompts = (
            system + random_prompt(400, seed=5, vocab=250),
            system + random_prompt(12, seed=6, vocab=250),
        )
        results, _ = _run_together(hot, [dict(prompt_ids=p, max_tokens=2) for p in prompts])
        assert results[1].metrics.cached_tokens == 0
    finally:
        hot.close()


def test_a_request_arriving_during_a_restore_joins_that_steps_group(tmp_path, models_dir):
    """A request that arrives while a step restores another starts in the same step (the
    engine admits arrivals after each start) and their rests go through one forward; both
    replies equal each request alone on a cold engine. Without it the second request
    would start a step later, after the first's rest went through alone."""
    kw = dict(prefill_chunk=256, bitwise=False)
    cold = make_engine("tiny:llama", tmp_path / "cold", models_dir, no_cache=True, **kw)
    hot = make_engine("tiny:llama", tmp_path / "hot", models_dir, **kw)
    try:
        cold.record_logprobs = hot.record_logprobs = 4
        system = random_prompt(SYSTEM, seed=21, vocab=250)
        generate(hot, system + random_prompt(5, seed=1, vocab=250), max_tokens=2)
        first, second = (system + random_prompt(20 + k, seed=2 + k, vocab=250) for k in (0, 1))
        late: list = []
        calls: list[int] = []
        admit_arrived = hot.executor.scheduler.arrivals

        def arrivals() -> None:
            calls.append(len(hot.executor.prefilling))
            if len(calls) == 2:  # after the step's first start: it arrived during it
                late.append(
                    hot.submit(
                        GenerateRequest(sampling=SamplingParams(max_tokens=4), prompt_ids=second)
                    )
                )
            admit_arrived()

        hot.executor.scheduler.arrivals = arrivals
        (a,), (ha,) = _run_together(hot, [dict(prompt_ids=first, max_tokens=4)])
        b = late[0].wait(300)
        assert isinstance(b, Finished), b
        assert calls[:2] == [0, 1]  # before the first start, then after it
        assert hot.executor.peak_group == 2
        for r in (a, b):
            assert r.metrics.cached_tokens >= SYSTEM - hot.cache.block_size, r.metrics
        alone = [generate(cold, p, max_tokens=4) for p in (first, second)]
        for (want, hw), got, hg in zip(alone, (a, b), (ha, late[0]), strict=True):
            _assert_close(want, hw, got, hg)
    finally:
        cold.close()
        hot.close()
