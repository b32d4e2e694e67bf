"""``tierchat bench --workload ... --baseline server`` (cli/bench/workload_http.py): the client's
conversation tree, and the shipped CI workload through tierchat serve and mlx_lm.server
(a subprocess on 127.0.0.1) on a tiny model, each server with its own replies."""

from __future__ import annotations

import json

import pytest
from tierchat.cli.bench import workload_report as report
from tierchat.cli.bench.workload_http import Conversation
from tierchat.cli.main import main
from tierchat.cli.replay import Op

SERVERS = (report.TIERCHAT, report.MLX_LM_SERVER)


def ask(conv: Conversation, op: str, reply: str, **args) -> list[dict]:
    messages, commit = conv.request(Op(0, op, args))
    commit(reply)
    return messages


def test_conversation_sends_the_active_path_as_a_client_does():
    conv = Conversation("sys")
    assert ask(conv, "user", "r1", text="u1") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u1"},
    ]
    ask(conv, "user", "r2", text="u2")
    # regenerate: the path up to the last user turn; the new reply is selected
    assert [m["content"] for m in ask(conv, "regenerate", "r2b")] == ["sys", "u1", "r1", "u2"]
    assert [n.content for n in conv.path()] == ["sys", "u1", "r1", "u2", "r2b"]
    # swipe: the first reply of turn 1, then the last again
    conv.swipe(1, 0)
    assert [n.content for n in conv.path()] == ["sys", "u1", "r1", "u2", "r2"]
    conv.swipe(1, -1)
    assert conv.path()[-1].content == "r2b"
    # edit of turn 0: a new branch after the system prompt
    assert [m["content"] for m in ask(conv, "edit", "e1", turn=0, text="u1'")] == ["sys", "u1'"]
    assert [n.content for n in conv.path()] == ["sys", "u1'", "e1"]
    ask(conv, "user", "r3", text="u3")
    assert [m["content"] for m in conv.messages(conv.path())] == ["sys", "u1'", "e1", "u3", "r3"]


def test_conversation_refuses_what_a_client_cannot_do():
    conv = Conversation(None)
    with pytest.raises(ValueError, match="nothing to regenerate"):
        conv.request(Op(0, "regenerate", {}))
    with pytest.raises(ValueError, match="no user turn 0"):
        conv.request(Op(0, "edit", {"turn": 0, "text": "x"}))
    ask(conv, "user", "r1", text="u1")
    with pytest.raises(ValueError, match="has no reply 1"):
        conv.swipe(0, 1)
    assert ask(conv, "edit", "r", turn=0, text="v") == [{"role": "user", "content": "v"}]


def test_ci_workload_through_both_servers(tmp_path, models_dir, capsys):
    out_json = tmp_path / "w.json"
    argv = ["bench", "--workload", "chat-ci", "--baseline", "server", "--model", "tiny:qwen2"]
    argv += ["--block-size", "16", "--json", str(out_json)]
    argv += ["--cache-dir", str(tmp_path / "kv"), "--data-dir", str(tmp_path / "data")]
    argv += ["--models-dir", str(models_dir)]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out_json.read_text())
    assert doc["baseline"] == report.MLX_LM_SERVER
    rows = doc["rows"]
    assert len(rows) == 12
    assert [r["first"] for r in rows] == [*SERVERS] * 6
    for row in rows:
        for system in SERVERS:
            r = row[system]
            assert r["cached_tokens"] + r["prefill_tokens"] == r["prompt_tokens"] > 0
            assert 1 <= r["completion_tokens"] <= row["max_tokens"]
    by_kind: dict[str, list[dict]] = {}
    for row in rows:
        by_kind.setdefault(row["kind"], []).append(row)
    assert set(by_kind) == set(report.KINDS)
    for row in by_kind["new conversation"][1:]:
        # the second conversation's system prompt comes from each server's cache
        assert all(row[s]["cached_tokens"] > 0 for s in SERVERS)
    for row in by_kind["regenerate"]:
        assert row[report.TIERCHAT]["prefill_tokens"] == 0  # its kept logprobs
        assert row[report.MLX_LM_SERVER]["prefill_tokens"] == 1  # the longer entry cut back
    for row in by_kind["turn after a restart"]:
        assert row[report.MLX_LM_SERVER]["cached_tokens"] == 0  # nothing on disk
        assert row[report.TIERCHAT]["cached_by"]["ssd"] > 0
    for row in by_kind["next user turn"]:
        # the previous prompt and the server's own reply, sent back as text
        assert all(row[s]["cached_tokens"] > row[s]["prompt_tokens"] // 2 for s in SERVERS)
    assert [e["kind"] for e in doc["summary"]] == [*report.KINDS, "all"]
    total = next(e for e in doc["summary"] if e["kind"] == "all")
    for system in SERVERS:
        assert total[system]["prefill_tokens"] == sum(r[system]["prefill_tokens"] for r in rows)
    assert "through HTTP" in out and "same reply text in" in out
    assert "12/12 turn after a restart" in err
