"""Many requests at once (docs/DESIGN.md §20): batched replies equal the same requests run
alone, every way of ending early frees the engine within one step, and the engine shows
the requests it holds. Tiny models on the CPU in float32; deterministic (the engine is
held with :meth:`Engine.call` while requests queue, cancels happen in event callbacks)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from engine_kit import (
    LOGPROB_TOL,
    generate,
    make_engine,
    mlx_lm_tokens,
    random_prompt,
)
from engine_kit import request as make_request
from tierchat.core.api import (
    Failed,
    Finished,
    GenerateRequest,
    PrefillProgress,
    Stopping,
    TokenBatch,
)
from tierchat.core.chat.conversation_settings import ConversationSettings
from tierchat.core.models.tiny import TINY_ARCHS
from tierchat.core.sampling_params import SamplingParams


class Hold:
    """Keeps the engine thread busy in a :meth:`Engine.call` until :meth:`release`, so
    requests submitted meanwhile are admitted together."""

    def __init__(self, engine) -> None:
        self.gate, started = threading.Event(), threading.Event()

        def block() -> None:
            started.set()
            self.gate.wait(120)

        self.thread = threading.Thread(target=engine.call, args=(block, 180), daemon=True)
        self.thread.start()
        assert started.wait(120)

    def release(self) -> None:
        self.gate.set()
        self.thread.join(120)


def _prompts(vocab: int = 250) -> list[tuple[int, ...]]:
    shared = random_prompt(40, seed=11, vocab=vocab)
    return [
        shared + random_prompt(13, seed=1, vocab=vocab),  # restores the shared prefix
        random_prompt(71, seed=2, vocab=vocab),
        random_prompt(9, seed=3, vocab=vocab),
        shared + random_prompt(30, seed=4, vocab=vocab),
    ]


def _assert_close(a, ha, b, hb) -> None:
    assert a.token_ids == b.token_ids
    assert len(ha.trace.logprobs) == len(hb.trace.logprobs) > 0
    for x, y in zip(ha.trace.logprobs, hb.trace.logprobs, strict=True):
        assert float(np.abs(x - y).max()) < LOGPROB_TOL


@pytest.mark.parametrize("bitwise", [True, False], ids=["bitwise", "folded"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_batched_replies_equal_each_request_alone(arch, bitwise, tmp_path, models_dir):
    """Four requests decoded in one batch (one of them restoring a cached prefix, lengths
    9 to 71) give the tokens and logprobs of each run alone on a cold engine."""
    if not bitwise and arch not in ("llama", "gemma3", "qwen3_5"):
        pytest.skip("the folded schedule: one model of each layer kind")
    kw = dict(prefill_chunk=32, prefill_step=16, bitwise=bitwise)
    cold = make_engine(f"tiny:{arch}", tmp_path / "cold", models_dir, no_cache=True, **kw)
    hot = make_engine(f"tiny:{arch}", tmp_path / "hot", models_dir, **kw)
    try:
        cold.record_logprobs = hot.record_logprobs = 6
        prompts = _prompts()
        alone = [generate(cold, p, max_tokens=6) for p in prompts]
        generate(hot, prompts[0][:40] + (7, 7), max_tokens=2)  # the shared prefix, cached
        hold = Hold(hot)
        handles = [
            hot.submit(GenerateRequest(sampling=SamplingParams(max_tokens=6 + i), prompt_ids=p))
            for i, p in enumerate(prompts)
        ]
        hold.release()
        results = [h.wait(300) for h in handles]
        assert all(isinstance(r, Finished) for r in results), results
        assert hot.executor.batch.peak_merged >= 2  # they decoded in one batch
        assert handles[0].trace.restored_position > 0
        for (a, ha), b, hb in zip(alone, results, handles, strict=True):
            n = len(a.token_ids)
            assert b.token_ids[:n] == a.token_ids
            _assert_close(a, ha, type(a)(b.token_ids[:n], "", b.metrics), hb)
        # what they stored is what a request alone stores: each prompt again restores
        for p, (a, _) in zip(prompts, alone, strict=True):
            again, h = generate(hot, p, max_tokens=6)
            assert again.token_ids == a.token_ids
            assert h.trace.restored_position > 0
    finally:
        cold.close()
        hot.close()


@pytest.fixture
def engine(tmp_path, models_dir):
    e = make_engine("tiny:llama", tmp_path, models_dir, prefill_chunk=64, prefill_step=16)
    yield e
    e.close()


def _next_request_runs(engine) -> None:
    result, _ = generate(engine, random_prompt(5, seed=9), max_tokens=2)
    assert isinstance(result, Finished)


def test_cancel_while_queued_fails_it_before_any_work(engine):
    hold = Hold(engine)
    a = engine.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=3), prompt_ids=random_prompt(30))
    )
    b = engine.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=3), prompt_ids=random_prompt(30, seed=5))
    )
    b.cancel()
    hold.release()
    result = b.wait(120)
    assert isinstance(result, Failed) and result.kind == "cancelled"
    assert "before it started" in result.message
    assert isinstance(a.wait(120), Finished)
    events = list(b.events())
    assert isinstance(events[0], Stopping) and not any(isinstance(e, TokenBatch) for e in events)


def test_cancel_during_prefill_stops_at_the_next_piece_and_keeps_it(engine):
    """Cancelled after the first 16-token piece of a 200-token prompt: the prefill stops
    there (no second piece), keeps those tokens, and a retry restores them."""
    prompt = random_prompt(200, seed=6)
    seen: list = []

    def on_event(event) -> None:
        seen.append(event)
        if isinstance(event, PrefillProgress) and event.done > 0:
            handle.cancel()

    handle = engine.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=3), prompt_ids=prompt), on_event
    )
    result = handle.wait(120)
    assert isinstance(result, Failed) and result.kind == "cancelled"
    assert result.kept_tokens == 16
    progress = [e.done for e in seen if isinstance(e, PrefillProgress)]
    assert progress == [0, 16]
    assert any(isinstance(e, Stopping) for e in seen)
    _next_request_runs(engine)
    _, again = generate(engine, prompt, max_tokens=3)
    assert again.trace.restored_position >= 16


def test_cancel_during_decode_leaves_the_batch_at_the_next_step(engine):
    """A reply cancelled at its first token ends with that token while another request
    keeps decoding; the cancelled one's cache is stored like a finished reply's."""
    hold = Hold(engine)
    other = engine.submit(
        GenerateRequest(
            sampling=SamplingParams(max_tokens=12), prompt_ids=random_prompt(20, seed=8)
        )
    )

    def on_event(event) -> None:
        if isinstance(event, TokenBatch) and event.token_ids:
            handle.cancel()

    prompt = random_prompt(20, seed=7)
    handle = engine.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=50), prompt_ids=prompt), on_event
    )
    hold.release()
    result = handle.wait(120)
    assert isinstance(result, Finished)
    assert result.metrics.finish_reason == "cancelled"
    assert len(result.token_ids) == 1
    assert isinstance(other.wait(120), Finished)
    assert len(other.result.token_ids) == 12 or other.result.metrics.finish_reason == "stop"
    _next_request_runs(engine)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_a_reply_cancelled_at_its_first_token_stores_prompt_and_token(arch, tmp_path, models_dir):
    """A joining sequence's first token goes through the model with the batch's next step
    (docs/DESIGN.md §20), whose response for it is dropped; cancelled at that token, the
    cache stored for it holds prompt + token: the next turn restores past the prompt and
    equals a cold run (tokens, logprobs)."""
    e = make_engine(f"tiny:{arch}", tmp_path / "hot", models_dir, bitwise=False)
    hold = Hold(e)
    other = e.submit(
        GenerateRequest(
            sampling=SamplingParams(max_tokens=12), prompt_ids=random_prompt(20, seed=8)
        )
    )

    def on_event(event) -> None:
        if isinstance(event, TokenBatch) and event.token_ids:
            handle.cancel()

    prompt = random_prompt(24, seed=7)
    handle = e.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=50), prompt_ids=prompt), on_event
    )
    hold.release()
    result = handle.wait(120)
    assert isinstance(result, Finished) and result.metrics.finish_reason == "cancelled"
    assert len(result.token_ids) == 1
    assert isinstance(other.wait(120), Finished)
    follow = prompt + result.token_ids + random_prompt(6, seed=9)
    hot, hot_h = generate(e, follow, max_tokens=6)
    assert hot.metrics.cached_tokens > len(prompt)
    e.close()
    cold_e = make_engine(
        f"tiny:{arch}", tmp_path / "cold", models_dir, bitwise=False, no_cache=True
    )
    cold, cold_h = generate(cold_e, follow, max_tokens=6)
    cold_e.close()
    _assert_close(cold, cold_h, hot, hot_h)


def test_stats_show_the_requests_held(engine):
    """While one request decodes, stats list it and the one prefilling beside it."""
    snapshots: list = []
    hold = Hold(engine)

    def on_event(event) -> None:
        if isinstance(event, PrefillProgress) and event.done == 16:
            snapshots.append(engine.stats().requests)

    a = engine.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=4), prompt_ids=random_prompt(10))
    )
    b = engine.submit(
        GenerateRequest(
            sampling=SamplingParams(max_tokens=2), prompt_ids=random_prompt(150, seed=2)
        ),
        on_event,
    )
    hold.release()
    assert isinstance(a.wait(120), Finished) and isinstance(b.wait(120), Finished)
    (snap,) = snapshots
    assert [(s.state, s.prompt_tokens) for s in snap] == [("decoding", 10), ("prefill", 150)]
    assert snap[1].describe() == "prefill 16/150"
    assert snap[0].describe().startswith("decoding (")
    assert engine.stats().requests == ()


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_nothing_lost_under_load_and_after_a_restart(arch, tmp_path, models_dir):
    """Six conversations at once, each with turns, a regenerate and an edit, every reply
    equal to the same request run alone on a cold engine; after a restart each goes on from
    the SSD tier with replies still equal."""
    kw = dict(prefill_chunk=32, prefill_step=16)
    hot = make_engine(f"tiny:{arch}", tmp_path / "hot", models_dir, **kw)
    runs: list = []  # (request, handle), in any order
    lock = threading.Lock()

    def submit(engine, prompt, max_tokens=5):
        req = GenerateRequest(
            sampling=SamplingParams(max_tokens=max_tokens), prompt_ids=tuple(prompt)
        )
        handle = engine.submit(req)
        result = handle.wait(300)
        assert isinstance(result, Finished), result
        with lock:
            runs.append((req, handle))
        return result

    system = random_prompt(24, seed=99)
    lasts: dict[int, list[int]] = {}

    def conversation(c: int) -> None:
        prompt = list(system)
        for turn in range(3):
            prompt += random_prompt(7 + c, seed=100 * c + turn)
            reply = submit(hot, prompt)
            if turn == 1:
                submit(hot, prompt)  # regenerate
                edited = prompt[:-3] + [5, 6, 7]
                submit(hot, edited)  # an edit of the last message
            prompt += list(reply.token_ids)
        lasts[c] = prompt

    try:
        threads = [threading.Thread(target=conversation, args=(c,)) for c in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert len(lasts) == 6 and len(runs) == 6 * 5
        assert hot.executor.batch.peak_merged >= 2
    finally:
        hot.close()
    # the restart: every conversation goes on, together, from what the tiers kept
    again = make_engine(f"tiny:{arch}", tmp_path / "hot", models_dir, **kw)
    try:
        follow = {c: p + list(random_prompt(6, seed=7 + c)) for c, p in lasts.items()}
        handles = {
            c: again.submit(
                GenerateRequest(sampling=SamplingParams(max_tokens=5), prompt_ids=tuple(p))
            )
            for c, p in follow.items()
        }
        for c, h in handles.items():
            assert isinstance(h.wait(300), Finished)
            runs.append(
                (
                    GenerateRequest(
                        sampling=SamplingParams(max_tokens=5), prompt_ids=tuple(follow[c])
                    ),
                    h,
                )
            )
        restored = [h.result.metrics for h in handles.values()]
        assert all(m.cached_tokens > 0 for m in restored)
        assert sum(m.cached_by.get("ssd", 0) for m in restored) > 0
    finally:
        again.close()
    cold = make_engine(f"tiny:{arch}", tmp_path / "cold", models_dir, no_cache=True, **kw)
    try:
        for req, handle in runs:
            alone, alone_handle = generate(cold, req.prompt_ids, max_tokens=req.sampling.max_tokens)
            _assert_close(alone, alone_handle, handle.result, handle)
    finally:
        cold.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_seeded_sampling_while_batched_equals_the_request_alone(arch, tmp_path, models_dir):
    """A seeded request at temperature 0.8 gives the tokens it gives alone on an idle
    engine, whatever decodes beside it: an unseeded sampled request from the start, a
    second seeded one joining at its 3rd token and a greedy one at its 6th (lengths 9 to
    40), each of those equal to its own run alone too where it is reproducible."""
    kw = dict(prefill_chunk=32, prefill_step=16)
    cold = make_engine(f"tiny:{arch}", tmp_path / "cold", models_dir, no_cache=True, **kw)
    hot = make_engine(f"tiny:{arch}", tmp_path / "hot", models_dir, **kw)
    seeded = dict(prompt_ids=random_prompt(23, seed=21), max_tokens=16, temperature=0.8, seed=1234)
    joining = [
        dict(prompt_ids=random_prompt(40, seed=22), max_tokens=10, temperature=0.9, seed=77),
        dict(prompt_ids=random_prompt(9, seed=23), max_tokens=12),
    ]
    unseeded = dict(prompt_ids=random_prompt(31, seed=24), max_tokens=20, temperature=1.0)
    try:
        alone = [_alone(cold, r) for r in (seeded, *joining)]
        assert alone[0] != generate(cold, seeded["prompt_ids"], max_tokens=16)[0].token_ids
        assert alone[0] == _alone(cold, seeded)  # reproducible alone
        later: list = []
        tokens: list = []

        def on_event(event) -> None:  # engine thread: a join lands before the next step
            if isinstance(event, TokenBatch) and event.token_ids:
                tokens.extend(event.token_ids)
                if len(tokens) in (3, 6):
                    later.append(hot.submit(make_request(**joining[len(tokens) // 3 - 1])))

        hold = Hold(hot)
        handle = hot.submit(make_request(**seeded), on_event)
        other = hot.submit(make_request(**unseeded))
        hold.release()
        result = handle.wait(300)
        assert isinstance(result, Finished) and isinstance(other.wait(300), Finished)
        assert len(later) == 2 and all(isinstance(h.wait(300), Finished) for h in later)
        assert hot.executor.batch.peak_merged >= 3  # they decoded in one batch
        assert result.token_ids == alone[0]
        assert [h.result.token_ids for h in later] == alone[1:]
    finally:
        cold.close()
        hot.close()


def _alone(engine, request: dict) -> tuple[int, ...]:
    handle = engine.submit(make_request(**request))
    result = handle.wait(120)
    assert isinstance(result, Finished), result
    return result.token_ids


class _InterruptingOut:
    """The chat's output: Ctrl+C (KeyboardInterrupt) arrives while the first token is
    printed, as a terminal's SIGINT would during a stream."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.interrupted = False

    def write(self, text: str) -> None:
        self.parts.append(text)
        if len(self.parts) > 1 and text.strip() and not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt

    def flush(self) -> None:
        pass


def test_ctrl_c_in_chat_stops_the_reply_at_the_next_step(engine, tmp_path):
    """``tierchat chat``: Ctrl+C during a reply prints "stopping…", the reply ends with
    the token it had (the engine steps once more at most) and is stored as cancelled."""
    import io

    from tierchat.cli.chat import LineChat
    from tierchat.core.chat.session import ChatSession
    from tierchat.core.chat.store import ConversationStore

    session = ChatSession(
        engine,
        ConversationStore(tmp_path / "c.sqlite"),
        ConversationSettings(sampling=SamplingParams(max_tokens=200)),
    )
    session.new_conversation()
    out = _InterruptingOut()
    chat = LineChat(session, io.StringIO(), out, io.StringIO())
    turns: list = []

    def hold_first_token(event) -> None:  # the engine thread waits for the Ctrl+C
        if isinstance(event, TokenBatch) and event.token_ids and len(turns) == 1:
            turns.append(turns[0].request_handle._cancel.wait(60))

    def start():
        turns.append(session.send("tell me a story", on_event=hold_first_token))
        return turns[0]

    chat.stream(start)
    text = "".join(out.parts)
    assert out.interrupted and "[stopping…]" in text
    assert turns[1] is True  # the cancel came while the engine waited at token 1
    last = engine.stats().last_turn
    assert last.finish_reason == "cancelled"
    assert last.generation_tokens == 1  # the next step ended it
    _next_request_runs(engine)


def _quantized_tiny(arch: str, models_dir, target):
    """``tiny:<arch>`` with 4-bit weights (groups of 32), as ``mlx_lm.convert -q`` writes
    them (``quantize_model``: every layer whose input size is a multiple of the group), in
    the MLX model dir ``target``; returns it as a model spec."""
    import shutil

    from mlx_lm.utils import load_model, quantize_model, save_config, save_model
    from tierchat.core.models.tiny import materialize_tiny

    source = materialize_tiny(arch, models_dir)
    model, config = load_model(source)
    model, config = quantize_model(model, config, group_size=32, bits=4)
    target.mkdir(parents=True)
    save_model(target, model)
    save_config(config, target / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target / name)
    return str(target)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_4bit_weights_batch_and_equal_each_request_alone(arch, tmp_path, models_dir):
    """A model with quantized weights (4-bit, mlx-lm's ``quantize_model``) batches like
    any other: four requests decode in one merged batch (one restoring a cached prefix)
    and each gives the tokens and logprobs of the same request alone on a cold engine."""
    spec = _quantized_tiny(arch, models_dir, tmp_path / "q4")
    kw = dict(prefill_chunk=32, prefill_step=16)
    cold = make_engine(spec, tmp_path / "cold", models_dir, no_cache=True, **kw)
    hot = make_engine(spec, tmp_path / "hot", models_dir, **kw)
    try:
        assert hot.loaded.quantized
        cold.record_logprobs = hot.record_logprobs = 6
        prompts = _prompts()
        alone = [generate(cold, p, max_tokens=6) for p in prompts]
        generate(hot, prompts[0][:40] + (7, 7), max_tokens=2)  # the shared prefix, cached
        hold = Hold(hot)
        handles = [
            hot.submit(GenerateRequest(sampling=SamplingParams(max_tokens=6), prompt_ids=p))
            for p in prompts
        ]
        hold.release()
        results = [h.wait(300) for h in handles]
        assert all(isinstance(r, Finished) for r in results), results
        assert hot.executor.batch.peak_merged == 4  # all four in one merged batch
        assert handles[0].trace.restored_position > 0
        for (a, ha), b, hb in zip(alone, results, handles, strict=True):
            _assert_close(a, ha, b, hb)
    finally:
        cold.close()
        hot.close()


def test_a_retry_after_another_request_restores_the_cancelled_pieces(tmp_path, models_dir):
    """A prefill cancelled after five 8-token pieces (40 tokens: two 16-token blocks and
    half of one), then another request (which takes the resident cache), then the retry:
    it restores all 40 tokens from the hot tier (the cancel stored its end)."""
    engine = make_engine("tiny:llama", tmp_path, models_dir, prefill_chunk=64, prefill_step=8)
    try:
        prompt = random_prompt(200, seed=12)

        def on_event(event) -> None:
            if isinstance(event, PrefillProgress) and event.done >= 40:
                handle.cancel()

        handle = engine.submit(
            GenerateRequest(sampling=SamplingParams(max_tokens=3), prompt_ids=prompt), on_event
        )
        result = handle.wait(120)
        assert isinstance(result, Failed) and result.kept_tokens == 40
        _next_request_runs(engine)
        assert engine.stats().resident.tokens != 40  # the other request's now
        _, again = generate(engine, prompt, max_tokens=3)
        assert again.trace.restored_position == 40
    finally:
        engine.close()


def test_batched_penalties_stop_strings_and_continue_equal_each_request_alone(tmp_path, models_dir):
    """Requests with penalties and a stop string decode in one batch beside a plain one:
    each gives the tokens, logprobs and text of the same request alone on a cold engine;
    the plain one finishes last (in the merged batch) and its continue prefills nothing
    and equals one longer generation (the logprobs after its last token were kept)."""
    kw = dict(prefill_chunk=32, prefill_step=16)
    cold = make_engine("tiny:llama", tmp_path / "cold", models_dir, no_cache=True, **kw)
    hot = make_engine("tiny:llama", tmp_path / "hot", models_dir, **kw)
    try:
        cold.record_logprobs = hot.record_logprobs = 6
        prompts = _prompts()
        plain, _ = generate(cold, prompts[2], max_tokens=12)
        text = plain.text
        penalized = random_prompt(40, seed=3)  # its greedy reply repeats a recent token
        unpenalized, _ = generate(cold, penalized, max_tokens=10)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop.strip() and text.find(stop) > 0, text
        reqs = [
            dict(prompt_ids=penalized, max_tokens=10, repetition_penalty=1.8),
            dict(prompt_ids=penalized, max_tokens=10, presence_penalty=1.5),
            dict(prompt_ids=prompts[2], max_tokens=12, stop=(stop,)),
            dict(prompt_ids=prompts[3], max_tokens=14),
        ]
        alone = [
            generate(cold, r["prompt_ids"], **{k: v for k, v in r.items() if k != "prompt_ids"})
            for r in reqs
        ]
        assert alone[2][0].metrics.finish_reason == "stop"
        for (a, _), r in zip(alone[:2], reqs[:2], strict=True):  # the penalties applied
            processors = {k: v for k, v in r.items() if k.endswith("penalty")}
            assert a.token_ids == mlx_lm_tokens(cold, penalized, 10, **processors)
            assert a.token_ids != unpenalized.token_ids
        assert alone[2][0].text == text[: text.find(stop)]
        hold = Hold(hot)
        handles = [hot.submit(make_request(**r)) for r in reqs]
        hold.release()
        results = [h.wait(300) for h in handles]
        assert all(isinstance(r, Finished) for r in results), results
        assert hot.executor.batch.peak_merged >= 2  # they decoded in one batch
        for (a, ha), b, hb in zip(alone, results, handles, strict=True):
            _assert_close(a, ha, b, hb)
            assert b.text == a.text
            assert b.metrics.finish_reason == a.metrics.finish_reason
        streamed = "".join(e.text for e in handles[2].events() if isinstance(e, TokenBatch))
        assert streamed == alone[2][0].text  # no part of the stop string was shown
        cold.record_logprobs = 18
        whole, whole_h = generate(cold, prompts[3], max_tokens=18)
        more, more_h = generate(hot, prompts[3] + results[3].token_ids, max_tokens=4)
        assert more.metrics.prefill_tokens == 0, more.metrics
        assert results[3].token_ids + more.token_ids == whole.token_ids
        assert len(more_h.trace.logprobs) == 4
        for x, y in zip(more_h.trace.logprobs, whole_h.trace.logprobs[14:], strict=True):
            assert float(np.abs(x - y).max()) < LOGPROB_TOL
    finally:
        cold.close()
        hot.close()


@pytest.mark.parametrize("bitwise", [False, True], ids=["folded", "bitwise"])
def test_a_lone_prefill_on_the_folded_schedule_is_cut_by_time_not_by_step(
    bitwise, tmp_path, models_dir
):
    """With ``prefill_step`` set (the CPU's default for real models), a request prefilling
    alone on the folded schedule runs pieces of about ``LONE_PIECE_S`` of measured work
    once a rate is known (a tiny model: the whole prompt at once), not one forward per
    step multiple; the bitwise schedule keeps its cuts at the step's multiples (positions
    only). Counted in PrefillProgress events, one per piece after the first at 0."""
    e = make_engine("tiny:llama", tmp_path, models_dir, bitwise=bitwise, prefill_step=16)
    generate(e, random_prompt(40, seed=1), max_tokens=2)  # measures the prefill rate
    pieces: list[int] = []

    def on_event(event) -> None:
        if isinstance(event, PrefillProgress) and event.done > 0:
            pieces.append(event.done)

    prompt = random_prompt(100, seed=2)
    result = e.submit(
        GenerateRequest(sampling=SamplingParams(max_tokens=2), prompt_ids=prompt), on_event
    ).wait(120)
    assert isinstance(result, Finished)
    e.close()
    if bitwise:
        assert len(pieces) >= 100 // 16  # every multiple of 16 a cut
    else:
        assert len(pieces) == 1
