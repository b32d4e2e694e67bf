"""Sampling controls (core/engine/sampling.py): each one reaches the sampler, on a tiny model.

Penalties are checked against mlx-lm itself: ``generate_step`` fed the whole prompt with
mlx-lm's processors (so they see the prompt's last tokens) gives the tokens the engine
gives, cold and from the cache. Top-k and min-p at a high temperature narrow the choice
to the greedy token; a stop string ends the reply before it.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from engine_kit import generate, make_engine, mlx_lm_tokens, random_prompt
from tierchat.core.api import GenerateRequest, TokenBatch
from tierchat.core.engine.sampling import (
    SeededSampler,
    StopStrings,
    make_request_sampler,
)
from tierchat.core.sampling_params import SamplingError, SamplingParams

PROMPT = random_prompt(40, seed=3)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, models_dir):
    e = make_engine("tiny:llama", tmp_path_factory.mktemp("sampling"), models_dir, bitwise=False)
    yield e
    e.close()


def test_sampler_controls_narrow_a_crafted_distribution():
    logprobs = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = lambda **kw: {  # noqa: E731
        make_request_sampler(GenerateRequest((1,), sampling=SamplingParams(temperature=1.0, **kw)))
        .sampler(logprobs)
        .item()
        for _ in range(200)
    }
    mx.random.seed(0)
    assert draws() == {0, 1, 2, 3}
    assert draws(top_k=2) == {0, 1}
    assert draws(min_p=0.5) == {0, 1}  # 0.3 >= 0.5 * 0.5; 0.15 is not
    assert draws(top_p=0.7) == {0, 1}


@pytest.mark.parametrize("controls", [{}, {"top_k": 3, "min_p": 0.05, "top_p": 0.9}])
def test_a_seeded_sampler_draws_its_own_stream_between_other_draws(controls):
    """:class:`SeededSampler` gives, call by call, the draws of mlx-lm's sampler after
    ``mx.random.seed(seed)`` alone, though other draws from the global key come between
    its calls; and its stream's next key is the key the sampler itself leaves after as
    many calls from the seed (one split per call, what it computes on the CPU)."""
    logprobs = mx.log(mx.softmax(mx.random.normal((1, 64), key=mx.random.key(3))))
    sampling = make_request_sampler(
        GenerateRequest((1,), sampling=SamplingParams(temperature=0.8, **controls))
    )
    mx.random.seed(2**64 - 5)  # a seed whose key uses both 32-bit halves
    alone = [sampling.sampler(logprobs).item() for _ in range(30)]
    assert len(set(alone)) >= 3  # it samples
    seeded = SeededSampler(sampling.sampler, 2**64 - 5)
    other = make_request_sampler(
        GenerateRequest((1,), sampling=SamplingParams(temperature=1.0))
    ).sampler
    draws = []
    for _ in range(30):
        other(logprobs)  # an unseeded request's draw in between
        draws.append(seeded(logprobs).item())
    assert draws == alone
    mx.random.seed(2**64 - 5)
    for _ in range(30):
        sampling.sampler(logprobs)
    mx.eval(mx.random.state[0])
    assert mx.random.state[0].tolist() == [seeded.seed >> 32, seeded.seed & 0xFFFFFFFF]


@pytest.mark.parametrize(
    "penalty",
    [
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.5},
    ],
)
def test_penalties_equal_mlx_lm_over_the_whole_prompt_cold_and_cached(engine, penalty):
    plain, _ = generate(engine, PROMPT, max_tokens=10)
    want = mlx_lm_tokens(engine, PROMPT, 10, **penalty)
    assert want != plain.token_ids  # the penalty changes this reply
    first, _ = generate(engine, PROMPT, max_tokens=10, **penalty)
    assert first.token_ids == want
    again, _ = generate(engine, PROMPT, max_tokens=10, **penalty)  # from the cache
    assert again.token_ids == want
    # the first token comes from processed logits: one token is computed again
    assert again.metrics.prefill_tokens == 1, again.metrics
    # and the cache's kept logprobs stay the model's own: no penalty leaks into them
    back, _ = generate(engine, PROMPT, max_tokens=10)
    assert back.token_ids == plain.token_ids and back.metrics.prefill_tokens == 0


@pytest.mark.parametrize("control", [{"top_k": 1}, {"min_p": 0.9999}])
def test_top_k_and_min_p_reach_the_sampler(engine, control):
    greedy, _ = generate(engine, PROMPT, max_tokens=12)
    hot, _ = generate(engine, PROMPT, max_tokens=12, temperature=5.0, seed=7)
    assert hot.token_ids != greedy.token_ids  # a high temperature wanders off greedy
    narrowed, _ = generate(engine, PROMPT, max_tokens=12, temperature=5.0, seed=7, **control)
    assert narrowed.token_ids == greedy.token_ids


def test_a_stop_string_ends_the_reply_before_it(engine):
    full, _ = generate(engine, PROMPT, max_tokens=16)
    text = full.text
    assert len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = text[: text.find(stop)]
    handle = engine.submit(
        GenerateRequest(PROMPT, sampling=SamplingParams(max_tokens=16, stop=("\x00never", stop)))
    )
    out = handle.wait(120)
    assert out.text == want and out.metrics.finish_reason == "stop"
    streamed = "".join(e.text for e in handle.events() if isinstance(e, TokenBatch))
    assert streamed == want  # no part of the stop string was ever shown


def test_stop_strings_hold_back_a_possible_start():
    s = StopStrings(["END", "\n\n"])
    assert s.feed("abc E") == ("abc ", False)
    assert s.feed("abc EN") == ("abc ", False)
    assert s.feed("abc ENx") == ("abc ENx", False)
    assert s.feed("abc\n") == ("abc", False)
    assert s.feed("abc\n\nmore END") == ("abc", True)


def test_out_of_range_values_are_refused_by_name():
    """One record, checked when made: a bad value raises ``SamplingError`` naming the
    field (which serve, the TUI, ``chat`` and the config file each show)."""
    for kw in (
        {"top_k": -1},
        {"min_p": 1.0},
        {"repetition_penalty": 0},
        {"presence_penalty": 3},
        {"stop": ["x"] * 17},
        {"top_p": 0},
        {"temperature": 5.5},
        {"max_tokens": 0},
        {"seed": -1},
        {"temperature": "warm"},
        {"repetition_context_size": 0},
    ):
        (field,) = kw
        with pytest.raises(SamplingError, match=f"^{field} ") as e:
            SamplingParams(**kw)
        assert e.value.field == field
    with pytest.raises(SamplingError, match="^top_k"):
        dataclasses.replace(SamplingParams(), top_k=-3)  # a replace is checked again
    assert SamplingParams(temperature=1, stop=["", "END"]).temperature == 1.0
    assert SamplingParams(stop=["", "END"]).stop == ("END",)


def test_stop_strings_name_the_one_that_matched_and_scan_once():
    s = StopStrings(["END", "STOP"])
    text = ""
    for piece in ["abc ", "ST", "O", "x and E", "N", "D more"]:
        text += piece
        safe, hit = s.feed(text)
    assert (safe, hit, s.matched) == ("abcSTOx and ".replace("abc", "abc "), True, "END")
