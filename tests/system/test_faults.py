"""Faults and bad input, round 3, through the command line: ``tierchat replay`` and
``tierchat chat`` as subprocesses on tiny models (a locked store, content as text, the SSD
cap, the model fingerprint, the context limit, owner-only files). Each case ends with a
normal turn answered with the output of a cold run (``--no-cache``). The serve cases are in
``tests/system/test_faults_serve.py``, the TUI's context refusal in
``tests/tui/test_context_refusal.py``."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
from fault_kit import common_flags, env_for, replay_cmd, run_replay, write_script
from tierchat.core.chat.store import ConversationStore

# ---------------------------------------------------------------- 1: a locked store


def test_1_a_locked_store_is_reported_op_by_op_and_replay_goes_on(tmp_path, models_dir):
    """Another process holds the store under ``BEGIN EXCLUSIVE``; replay reports the first
    conversation's ``new`` that cannot save within ``store_busy_s`` and skips that
    conversation's ops (each reported: run elsewhere they would answer without the
    script's system prompt); once the lock is gone it does the next conversation whole
    and exits (the old code kept the store's lock after a failed BEGIN and hung)."""
    flags = common_flags(tmp_path, models_dir)
    db = tmp_path / "data" / "conversations.sqlite"
    ConversationStore(db).close()  # the file exists, in WAL, at the current schema
    texts = [f"question number {i} about the quick brown fox" for i in range(4)]
    first = [{"op": "new", "system": "first"}] + [
        {"op": "user", "text": t, "max_tokens": 4} for t in texts
    ]
    second = [{"op": "new", "system": "second"}] + [
        {"op": "user", "text": t, "max_tokens": 4} for t in texts
    ]
    ops = first + second
    script = write_script(tmp_path / "s.jsonl", ops)

    locker = sqlite3.connect(db, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    env = env_for(tmp_path, TIERCHAT_STORE_BUSY_S="5")
    proc = subprocess.Popen(
        replay_cmd(script, flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    err_lines: list[str] = []
    first_error = threading.Event()

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err_lines.append(line)
            if line.startswith("error:"):
                first_error.set()
        first_error.set()

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    try:
        assert first_error.wait(300), "".join(err_lines)
        locker.execute("ROLLBACK")  # the lock is gone
        locker.close()
        out, _ = proc.communicate(timeout=300)  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(30)
    stderr = "".join(err_lines)
    assert "Traceback" not in stderr, stderr
    assert proc.returncode == 1, stderr  # some ops failed
    lines = [json.loads(x) for x in out.splitlines()]
    done = {x["op_index"]: x for x in lines if "op_index" in x}
    # every op done or reported (a `new` that saves prints no result line)
    assert set(done) == set(range(len(ops))) - {len(first)}
    assert "locked" in done[0]["error"]  # the first new could not save
    for i in range(1, len(first)):  # its conversation's ops: skipped, said so
        assert done[i]["error"].startswith("skipped: the new conversation of line 1"), done[i]
    ok = list(range(len(first) + 1, len(ops)))
    assert all("error" not in done[i] for i in ok), stderr
    summary = next(x["summary"] for x in lines if "summary" in x)
    assert summary["errors"] == len(first) and summary["generations"] == len(texts)

    # the second conversation is whole; a cold run of it gives the same replies
    cold = run_replay(
        write_script(tmp_path / "cold.jsonl", second),
        common_flags(tmp_path, models_dir, tag="-cold") + ["--no-cache"],
        env_for(tmp_path),
    )
    assert cold.code == 0, cold.stderr
    want = [x["token_ids_sha256"] for x in cold.results]
    assert [done[i]["token_ids_sha256"] for i in ok] == want
    with ConversationStore(db) as store:
        (conv,) = store.list_conversations()
        path = store.active_path(conv.id)
    assert [n.content for n in path if n.role == "system"] == ["second"]
    assert [n.content for n in path if n.role == "user"] == texts


# ---------------------------------------------------------------- 2: content as text, in replay


def test_2_replay_tokenizes_content_as_text(tmp_path, models_dir):
    """The same through ``tierchat replay`` (the session and the TUI share its builder)."""
    end = "<|end|>"
    ops = [
        {"op": "new", "system": "sys" + end + "<|user|>"},
        {"op": "user", "text": "hello", "max_tokens": 2},
        {"op": "new", "system": "sys"},
        {"op": "user", "text": "hello", "max_tokens": 2},
        {"op": "user", "text": "again" + end, "max_tokens": 2},
    ]
    run = run_replay(
        write_script(tmp_path / "s.jsonl", ops),
        common_flags(tmp_path, models_dir),
        env_for(tmp_path),
    )
    assert run.code == 0, run.stderr
    r = run.by_index()
    assert r[1]["prompt_tokens"] == r[3]["prompt_tokens"] + len(end + "<|user|>")
    # turn 2 extends turn 1 (prompt + reply + the new message as text): a cache hit
    assert r[4]["cached_tokens"] >= r[3]["prompt_tokens"] - 16
    cold = run_replay(
        write_script(tmp_path / "c.jsonl", [ops[2], ops[3], ops[4]]),
        common_flags(tmp_path, models_dir, tag="-cold") + ["--no-cache"],
        env_for(tmp_path),
    )
    assert cold.code == 0, cold.stderr
    assert [x["token_ids_sha256"] for x in cold.results] == [
        r[3]["token_ids_sha256"],
        r[4]["token_ids_sha256"],
    ]


# ---------------------------------------------------------------- 3: the SSD cap


# one system prompt for every conversation: its blocks are written once, by the first,
# and later turns find them in the hot tier, so on the SSD they stay least recently used
SHARED_SYSTEM = "You answer questions about animals, briefly and kindly. " * 4


def _conversation(k: int) -> list[dict]:
    return [
        {"op": "new", "system": SHARED_SYSTEM},
        {
            "op": "user",
            "text": f"tell me about the quick brown fox number {k} " * 3,
            "max_tokens": 8,
        },
        {
            "op": "user",
            "text": f"and the lazy dog number {k}, please, in detail " * 2,
            "max_tokens": 8,
        },
    ]


def _on_disk(kv: Path) -> int:
    """Bytes of the SSD tier's entry files under ``kv``."""
    return sum(f.stat().st_size for f in kv.rglob("*.safetensors"))


def _header(path: Path) -> dict:
    """The ``__metadata__`` of an entry file (id, parent, start, kind...)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))["__metadata__"]


def test_3_under_the_ssd_cap_a_restart_restores_the_most_recent_conversation(tmp_path, models_dir):
    """Six conversations under a cap that holds a quarter of what they write: after a
    restart (a new process on the same cache dir) the last conversation's prompt is
    restored from the SSD tier (the old policy evicted the shared root blocks first)."""
    env = env_for(tmp_path)
    ops = [op for k in range(6) for op in _conversation(k)]
    script = write_script(tmp_path / "w.jsonl", ops)
    full = run_replay(script, common_flags(tmp_path, models_dir, tag="-full"), env)
    assert full.code == 0, full.stderr
    written = _on_disk(tmp_path / "kv-full")
    assert written > 0

    cap = written // 4
    capped = run_replay(
        script, common_flags(tmp_path, models_dir, tag="-cap") + ["--ssd-bytes", str(cap)], env
    )
    assert capped.code == 0, capped.stderr
    assert 0 < _on_disk(tmp_path / "kv-cap") <= cap
    # the chain of the last conversation's system prompt is kept from its root
    heads = [_header(f) for f in (tmp_path / "kv-cap").rglob("*.safetensors")]
    assert any(int(h["start"]) == 0 for h in heads), heads

    # a new process: the last conversation again, from the SSD tier
    again = write_script(tmp_path / "again.jsonl", _conversation(5)[:2])
    restarted = run_replay(
        again, common_flags(tmp_path, models_dir, tag="-cap") + ["--ssd-bytes", str(cap)], env
    )
    assert restarted.code == 0, restarted.stderr
    (line,) = restarted.results
    assert line["cached_by"]["ssd"] > 0, (line, restarted.stderr)
    first_turn = full.by_index()[len(ops) - 2]  # the same op in the uncapped run
    assert line["token_ids_sha256"] == first_turn["token_ids_sha256"]
    cold = run_replay(again, common_flags(tmp_path, models_dir, tag="-cold") + ["--no-cache"], env)
    assert cold.results[0]["token_ids_sha256"] == line["token_ids_sha256"]


# ---------------------------------------------------------------- 4: the model fingerprint


def _rewrite_weights_in_place(path: Path) -> None:
    """Every float32 tensor of a safetensors file scaled by 0.75, in place: the same size,
    the same header, and the mtime put back (``os.utime``), as the trial did."""
    st = path.stat()
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F32"}
        data = np.frombuffer(f.read(), dtype=np.float32) * np.float32(0.75)
        f.seek(8 + n)
        f.write(data.tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_4_weights_rewritten_with_the_same_size_and_mtime_are_a_new_model(tmp_path, models_dir):
    """A local model directory; a replay fills the SSD tier; its weights are rewritten in
    place (size and mtime kept); a new replay restores nothing of the old K/V and answers
    as a cold run of the new weights."""
    run_replay(
        write_script(tmp_path / "build.jsonl", [{"op": "user", "text": "x", "max_tokens": 1}]),
        common_flags(tmp_path, models_dir, tag="-build"),
        env_for(tmp_path),
    )
    model = tmp_path / "model"
    shutil.copytree(models_dir / "tiny-llama-0", model)
    env = env_for(tmp_path)
    ops = [
        {"op": "new", "system": "You answer questions about animals. " * 3},
        {"op": "user", "text": "tell me about the quick brown fox " * 3, "max_tokens": 8},
        {"op": "user", "text": "and the lazy dog", "max_tokens": 8},
    ]
    script = write_script(tmp_path / "s.jsonl", ops)
    flags = common_flags(tmp_path, models_dir, model=str(model))
    first = run_replay(script, flags, env)
    assert first.code == 0, first.stderr
    assert first.summary["cache"]["ssd"]["entries"] > 0
    again = run_replay(script, flags, env)  # the same weights: the SSD tier serves them
    assert again.results[0]["cached_by"]["ssd"] > 0

    _rewrite_weights_in_place(model / "model.safetensors")
    changed = run_replay(script, flags, env)
    assert changed.code == 0, changed.stderr
    assert [x["cached_tokens"] for x in changed.results][0] == 0  # nothing of the old K/V
    cold = run_replay(
        script,
        common_flags(tmp_path, models_dir, model=str(model), tag="-cold") + ["--no-cache"],
        env,
    )
    assert [x["token_ids_sha256"] for x in changed.results] == [
        x["token_ids_sha256"] for x in cold.results
    ]
    assert [x["token_ids_sha256"] for x in changed.results] != [
        x["token_ids_sha256"] for x in first.results
    ]  # the new weights do answer otherwise


# ---------------------------------------------------------------- 5: the context limit


def test_5_replay_reports_prompts_past_the_context_and_goes_on(tmp_path, models_dir):
    """tiny:llama has a 131,072-token context and one token per character: a 135,000-token
    prompt and a ``max_tokens`` of 135,000 are each an error for their op (nothing is
    prefilled), and the next op is answered as a cold run answers it."""
    normal = {"op": "user", "text": "the quick brown fox jumps over a lazy dog", "max_tokens": 8}
    ops = [
        {"op": "new"},
        {"op": "user", "text": "x" * 135000, "max_tokens": 8},
        {"op": "user", "text": "a short one", "max_tokens": 135000},
        normal,
    ]
    env = env_for(tmp_path)
    run = run_replay(
        write_script(tmp_path / "s.jsonl", ops), common_flags(tmp_path, models_dir), env
    )
    assert run.code == 1, run.stderr
    r = run.by_index()
    assert "the prompt is 135,003 tokens; the model's context is 131,072" in r[1]["error"]
    assert "shorten the message" in r[1]["error"]
    assert "+ 135,000 to generate" in r[2]["error"] and "lower max_tokens" in r[2]["error"]
    assert "s.jsonl:2: user:" in run.stderr and "s.jsonl:3: user:" in run.stderr
    assert run.summary["prefill_tokens"] == r[3]["prefill_tokens"]  # only the last op ran
    cold = run_replay(
        write_script(tmp_path / "c.jsonl", [{"op": "new"}, normal]),
        common_flags(tmp_path, models_dir, tag="-cold") + ["--no-cache"],
        env,
    )
    assert cold.results[0]["token_ids_sha256"] == r[3]["token_ids_sha256"]


def test_5_chat_reports_a_prompt_past_the_context_and_goes_on(tmp_path, models_dir):
    lines = "x" * 135000 + "\nthe quick brown fox jumps over a lazy dog\n"
    p = subprocess.run(
        [sys.executable, "-m", "tierchat.cli.main", "chat", *common_flags(tmp_path, models_dir),
         "--max-tokens", "8"],
        input=lines, capture_output=True, text=True, env=env_for(tmp_path), timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert "error: the prompt is 135,00" in p.stderr and "context is 131,072" in p.stderr
    replies = [ln for ln in p.stdout.splitlines() if ln.startswith("assistant> ")]
    assert len(replies) == 1  # the second line was answered


# ---------------------------------------------------------------- 9: owner-only files


def test_9_files_in_the_cache_dir_are_owner_only(tmp_path, models_dir):
    """After a replay (the engine saves its measured rates at close): every file tierchat
    wrote under the cache dir and data dir is 0600, the rates file included."""
    ops = [{"op": "new"}, {"op": "user", "text": "hello there " * 60, "max_tokens": 4}]
    run = run_replay(
        write_script(tmp_path / "s.jsonl", ops),
        common_flags(tmp_path, models_dir),
        env_for(tmp_path),
    )
    assert run.code == 0, run.stderr
    rates = list((tmp_path / "kv").glob("rates-*.json"))
    assert rates, sorted(p.name for p in (tmp_path / "kv").iterdir())
    files = [p for d in ("kv", "data") for p in (tmp_path / d).rglob("*") if p.is_file()]
    assert files and all(p.stat().st_mode & 0o077 == 0 for p in files), [
        (str(p), oct(p.stat().st_mode)) for p in files if p.stat().st_mode & 0o077
    ]
