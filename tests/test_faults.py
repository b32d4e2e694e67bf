"""Faults and bad input, round 3: each case runs through the real process (``tierchat
replay`` as a subprocess, HTTP against a real ``tierchat serve``, a tmux terminal for the
TUI) and ends with a normal request answered with the output of a cold run."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest
from fault_kit import common_flags, env_for, replay_cmd, run_replay, write_script
from tierchat.core.conversation import ConversationStore

# ---------------------------------------------------------------- 1: a locked store


def test_1_a_locked_store_is_reported_op_by_op_and_replay_goes_on(tmp_path, models_dir):
    """Another process holds the store under ``BEGIN EXCLUSIVE``; replay reports the ops
    that cannot save within ``store_busy_s`` and, once the lock is gone, does every op
    after it and exits (the old code kept the store's lock after a failed BEGIN and hung)."""
    flags = common_flags(tmp_path, models_dir)
    db = tmp_path / "data" / "conversations.sqlite"
    ConversationStore(db).close()  # the file exists, in WAL, at the current schema
    texts = [f"question number {i} about the quick brown fox" for i in range(8)]
    ops = [{"op": "new"}] + [{"op": "user", "text": t, "max_tokens": 4} for t in texts]
    script = write_script(tmp_path / "s.jsonl", ops)

    locker = sqlite3.connect(db, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    env = env_for(tmp_path, TIERCHAT_STORE_BUSY_S="2")
    proc = subprocess.Popen(
        replay_cmd(script, flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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
    assert "locked" in done[0]["error"]  # the first op could not save
    # every op was done or reported; once one saved, every later one did too
    assert set(done) == set(range(len(ops)))
    ok = [i for i in range(1, len(ops)) if "error" not in done[i]]
    assert ok and ok == list(range(ok[0], len(ops))), stderr
    for i in range(1, ok[0]):
        assert "locked" in done[i]["error"]
    summary = next(x["summary"] for x in lines if "summary" in x)
    assert summary["errors"] == ok[0] and summary["generations"] == len(ok)

    # the conversation holds the ops that saved; a cold run of it gives the same replies
    cold_ops = [{"op": "new"}] + [ops[i] for i in ok]
    cold = run_replay(
        write_script(tmp_path / "cold.jsonl", cold_ops),
        common_flags(tmp_path, models_dir, tag="-cold") + ["--no-cache"],
        env_for(tmp_path),
    )
    assert cold.code == 0, cold.stderr
    want = [x["token_ids_sha256"] for x in cold.results]
    assert [done[i]["token_ids_sha256"] for i in ok] == want
    with ConversationStore(db) as store:
        (conv,) = store.list_conversations()
        users = [n.content for n in store.active_path(conv.id) if n.role == "user"]
    assert users == [ops[i]["text"] for i in ok]
