"""Verify a turn against cold (core/chat/verify.py, docs/DESIGN.md §18).

The comparison itself on hand-made logprobs; then on ``tiny:llama`` in float32 on the CPU:
a cached turn (the resident cache, the first token from its kept logprobs) recomputed
teacher-forced agrees with a cold run bit for bit, on both schedules, and so do two cold
runs; the report is stored with the reply and logged in the events; ``tierchat verify``
runs a script and prints one report per reply. A verify reports its progress, stops
within a step of its cancel event, and leaves the chat's figures (lookups, the tiers'
hits and misses, tails, the resident cache, the last turn) as they were.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from engine_kit import make_engine
from tierchat.core.api import TokenBatch
from tierchat.core.chat.conversation_settings import ConversationSettings
from tierchat.core.chat.session import ChatSession
from tierchat.core.chat.store import ConversationStore
from tierchat.core.chat.verify import (
    Agreement,
    VerifyCancelled,
    VerifyError,
    VerifyReport,
    agreement,
    verify_reply,
)
from tierchat.core.sampling_params import SamplingParams


def test_agreement_counts_top1_first_difference_and_largest_delta():
    a = [
        np.log(np.array(p, np.float32)) for p in ([0.7, 0.2, 0.1], [0.4, 0.5, 0.1], [0.3, 0.3, 0.4])
    ]
    b = [a[0].copy(), np.log(np.array([0.6, 0.3, 0.1], np.float32)), a[2].copy()]
    got = agreement(a, b)
    assert (got.positions, got.top1_agree, got.first_diff) == (3, 2, 1)
    assert got.max_dlogprob == pytest.approx(float(np.max(np.abs(a[1] - b[1]))))
    on_reply = agreement(a, b, tokens=[0, 2, 2])  # the reply's tokens only
    assert on_reply.max_dlogprob == pytest.approx(abs(float(a[1][2] - b[1][2])))
    assert on_reply.first_diff == 1 and on_reply.top1_agree == 2
    same = agreement(a, [x.copy() for x in a])
    assert same.bitwise and same.top1_agree == 3 and same.max_dlogprob == 0.0
    assert "bitwise" in same.describe() and "first diff 1" in got.describe()
    report = VerifyReport(got, same, 40, 39, "m")
    assert VerifyReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    assert isinstance(report.cached, Agreement)


@pytest.mark.parametrize("bitwise", [True, False])
def test_a_cached_turn_verifies_bitwise_on_the_cpu(tmp_path, models_dir, bitwise):
    engine = make_engine("tiny:llama", tmp_path, models_dir, bitwise=bitwise)
    store = ConversationStore(tmp_path / "c.sqlite")
    try:
        session = ChatSession(
            engine, store, ConversationSettings(sampling=SamplingParams(max_tokens=8))
        )
        session.new_conversation(system="You are terse.")
        turn = session.send("Tell me about the tides and the moon, briefly please.")
        turn.wait(120)
        reply = turn.reply_node
        report = verify_reply(session, reply.id)
        assert report.cached_tokens == report.prompt_tokens > 0  # the cache served it all
        assert report.cached.positions == len(reply.token_ids) > 0
        assert report.cached.bitwise and report.floor.bitwise, report
        assert report.cached.top1_agree == report.cached.positions
        assert report.cached.max_dlogprob == 0.0
        stored = store.get_node(reply.id).meta
        assert VerifyReport.from_dict(stored["verify"]) == report
        assert stored["prompt_tokens"] == report.prompt_tokens  # the metrics stay
        assert any(text.startswith("verify vs cold") for _, text in engine.stats().events)
        with pytest.raises(VerifyError):
            verify_reply(session, turn.user_node.id)
    finally:
        engine.close()
        store.close()


def _figures(engine):
    """What a user reads of the cache: every counter a turn moves, and the last turn
    (once the SSD writer has written what earlier turns handed it)."""
    assert engine.cache.ssd.flush()
    st = engine.stats()
    return (
        st.lookups,
        (st.hot.entries, st.hot.hits, st.hot.misses),
        (st.ssd.entries, st.ssd.hits, st.ssd.misses),
        st.tails,
        st.resident,
        st.last_turn,
    )


def test_a_verify_reports_progress_and_moves_no_chat_figure(tmp_path, models_dir):
    engine = make_engine("tiny:llama", tmp_path, models_dir)
    store = ConversationStore(tmp_path / "c.sqlite")
    try:
        defaults = ConversationSettings.of(max_tokens=8)
        session = ChatSession(engine, store, defaults)
        session.new_conversation(system="You are terse.")
        first = session.send("Tell me about the tides and the moon, briefly please.")
        first.wait(120)
        second = session.send("And the sun, does it pull on the sea as well?")
        second.wait(120)
        before = _figures(engine)
        assert before[0].lookups == 2 and before[4].tokens > 0
        seen: list[tuple[int, int]] = []
        for turn in (second, first):  # the reply the resident cache holds, and an older one
            report = verify_reply(
                session, turn.reply_node.id, on_progress=lambda *a: seen.append(a)
            )
            # the second prompt holds the first reply, whose K/V decode computed: equal
            # within float rounding only (docs/DESIGN.md §18)
            assert report.cached.max_dlogprob < 1e-4 and report.floor.bitwise, report
            assert report.cached_tokens > 0  # the cached run did restore
            assert _figures(engine) == before
        # progress: the three runs' token positions, rising to the total
        n = report.prompt_tokens
        total = 3 * (n + report.cached.positions)
        last = [d for d, t in seen if t == total]
        assert last[-1] == total and len(last) >= 3 * report.cached.positions
        assert last == sorted(last)
        # the chat goes on as before: the next turn restores the resident cache
        third = session.send("Thanks, that is all.")
        third.wait(120)
        after = engine.stats()
        assert after.lookups.resident == before[0].resident + 1
        assert after.last_turn.prompt_tokens == third.reply_node.meta["prompt_tokens"]
    finally:
        engine.close()
        store.close()


def test_a_cancelled_verify_stops_within_a_step(tmp_path, models_dir):
    engine = make_engine("tiny:llama", tmp_path, models_dir)
    store = ConversationStore(tmp_path / "c.sqlite")
    try:
        defaults = ConversationSettings.of(max_tokens=48)
        session = ChatSession(engine, store, defaults)
        session.new_conversation(system="You are terse.")
        turn = session.send("Tell me about the tides and the moon, at length please.")
        turn.wait(120)
        reply = turn.reply_node
        assert len(reply.token_ids) == 48
        before = _figures(engine)
        cancel = threading.Event()
        seen: list[int] = []
        n, r = None, len(reply.token_ids)

        def on_progress(done: int, total: int) -> None:
            nonlocal n
            n = total // 3 - r
            seen.append(done)
            if done >= (n + r) + n + 2:  # the first cold run's third decode step
                cancel.set()

        # what the engine emits once the stop is set, counted on the engine thread (the
        # verify's own thread may still be draining events emitted before it, under load)
        emitted_after: list[object] = []
        submit = engine.submit

        def counting_submit(req, on_event):
            def counted(event):
                if cancel.is_set() and isinstance(event, TokenBatch) and event.token_ids:
                    emitted_after.append(event)
                on_event(event)

            return submit(req, counted)

        engine.submit = counting_submit
        try:
            with pytest.raises(VerifyCancelled):
                verify_reply(session, reply.id, on_progress=on_progress, cancel=cancel)
        finally:
            del engine.submit
        # each decode step emits one event: the stop lands at the next step or the one after
        assert len(emitted_after) <= 2, len(emitted_after)
        assert max(seen) < 2 * (n + r)  # the second cold run never started
        assert "verify" not in store.get_node(reply.id).meta  # a stopped verify stores nothing
        assert _figures(engine)[:4] == before[:4] and _figures(engine)[5] == before[5]
        # a stopped verify leaves the engine as it was: the next one runs to its report
        assert verify_reply(session, reply.id).cached.bitwise
    finally:
        engine.close()
        store.close()


def test_verify_command_runs_a_script(tmp_path, models_dir, capsys, monkeypatch):
    from tierchat.cli.main import main

    script = tmp_path / "s.jsonl"
    lines = [
        {"op": "new", "system": "You are terse."},
        {"op": "user", "text": "Name three rivers of Europe, please.", "max_tokens": 6},
        {"op": "regenerate", "max_tokens": 6},
    ]
    script.write_text("".join(json.dumps(x) + "\n" for x in lines))
    monkeypatch.setenv("TIERCHAT_BITWISE", "1")
    args = ["--model", "tiny:llama", "--models-dir", str(models_dir)]
    args += ["--cache-dir", str(tmp_path / "kv"), "--data-dir", str(tmp_path / "data")]
    code = main([*args, "verify", str(script)])
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert code == 0
    reports = [x for x in out if "verify" in x]
    assert [r["op_index"] for r in reports] == [1, 2]
    for r in reports:
        assert r["verify"]["cached"]["first_diff"] is None, r["line"]
        assert r["verify"]["floor"]["top1_agree"] == r["verify"]["floor"]["positions"] > 0
    # the stored conversation again, by id: the same figures
    code = main([*args, "verify", "--conversation", "1"])
    again = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert code == 0 and len(again) == 1 and again[0]["verify"]["cached"]["first_diff"] is None
    assert main([*args, "verify"]) == 2


def test_bitwise_asks_for_reproducible_attention_kernels(monkeypatch):
    from tierchat.core.device import DETERMINISTIC_ENV, use_deterministic_kernels

    monkeypatch.delenv("MLX_CUDA_USE_CUDNN_SDPA", raising=False)
    assert use_deterministic_kernels() == DETERMINISTIC_ENV == {"MLX_CUDA_USE_CUDNN_SDPA": "0"}
    monkeypatch.setenv("MLX_CUDA_USE_CUDNN_SDPA", "1")  # the user's own choice stays
    assert use_deterministic_kernels() == {}
