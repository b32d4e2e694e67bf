"""``tierchat bench --agent``: a short agent session (chat completions with tools, written
here in the recorded format) through tierchat serve and mlx_lm.server (subprocesses on
127.0.0.1), two copies at once, a restart in the middle, on a tiny model. No speed
asserts: what the bench counts and reports."""

from __future__ import annotations

import json

from tierchat.cli.main import main

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file of the project and return its text.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
SYSTEM = "You are a coding agent. Use the tools to look at files before you answer. " * 6
FILE = "def area(r):\n    return 3.14159 * r * r\n\n" * 8


def session(n: int) -> list[dict]:
    """``n`` requests of one growing conversation: each adds a read call and its result."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Read the files of this project and summarize them."},
    ]
    out = []
    for i in range(n):
        body = {"model": "local", "messages": list(messages), "tools": TOOLS, "stream": True}
        out.append({"api": "chat", "path": "/v1/chat/completions", "headers": {}, "body": body})
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "read", "arguments": json.dumps({"path": f"f{i}.py"})},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"# f{i}.py\n" + FILE},
        ]
    return out


def test_agent_bench_on_both_servers_with_copies_and_a_restart(tmp_path, models_dir, capsys):
    path = tmp_path / "agent-mini.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in session(4)))
    out = tmp_path / "out.json"
    argv = ["bench", "--model", "tiny:llama", "--models-dir", str(models_dir)]
    argv += ["--cache-dir", str(tmp_path / "kv"), "--data-dir", str(tmp_path / "data")]
    argv += ["--block-size", "16", "--agent", str(path), "--sessions", "2"]
    argv += ["--restart-after", "2", "--agent-max-tokens", "3", "--floor-points", "2"]
    argv += ["--fresh-kernel-cache", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc["servers"]) == {"tierchat", "mlx-lm"}
    prompts = {}
    for name, run in doc["servers"].items():
        rows = run["requests"]
        # every request of both copies, each phase on its side of the restart
        assert sorted((r["copy"], r["index"]) for r in rows) == [
            (c, i) for c in range(2) for i in range(4)
        ]
        assert all(r["phase"] == ("before" if r["index"] < 2 else "after") for r in rows)
        assert all(0 < r["ttft_s"] <= r["done_s"] and r["completion_tokens"] >= 1 for r in rows)
        assert run["restarts"] == 1 and len(run["calibration"]) == 2
        assert all(r["floor_s"] > 0 and r["cold_s"] >= r["floor_s"] for r in rows)
        # the copies differ only after the shared prefix: one more than the other's
        by = {(r["copy"], r["index"]): r for r in rows}
        for i in range(4):
            assert by[0, i]["new_tokens"] == by[1, i]["new_tokens"]
        # before the restart every server reuses the conversation's previous prompt
        for c in range(2):
            assert by[c, 1]["cached_tokens"] >= by[c, 0]["prompt_tokens"] // 16 * 16 - 16
        prompts[name] = {k: r["prompt_tokens"] for k, r in by.items()}
        assert run["summary"]["peak_rss_bytes"] > 0
    ours = {(r["copy"], r["index"]): r for r in doc["servers"]["tierchat"]["requests"]}
    theirs = {(r["copy"], r["index"]): r for r in doc["servers"]["mlx-lm"]["requests"]}
    # after the restart tierchat restores from its SSD tier (how much is the cache's
    # business, tested with it), mlx-lm starts empty: the first copy it serves then finds
    # nothing (the other may find that one's shared system prompt, as timing has it)
    for c in range(2):
        assert ours[c, 2]["cached_tokens"] > 0
    assert min(theirs[c, 2]["cached_tokens"] for c in range(2)) < theirs[0, 1]["prompt_tokens"] // 2
    summary = doc["servers"]["tierchat"]["summary"]
    assert summary["ssd_bytes"] > 0 and summary["peak_mlx_bytes"] > 0
    assert doc["servers"]["mlx-lm"]["summary"]["ssd_bytes"] is None
    ratios = doc["ratios"]
    assert set(ratios) == {"ttft_median", "ttft_p90", "ttft_worst", "tokens_per_s", "requests"}
    assert ratios["tokens_per_s"] is not None and not doc["servers"]["mlx-lm"]["failure"]
    assert ratios["requests"] == len(doc["servers"]["tierchat"]["requests"])  # every one
    text = capsys.readouterr().out
    assert "mini#2*" in text and "mlx-lm TTFT s" in text


def test_agent_bench_refuses_a_missing_session_and_a_bad_count(tmp_path, capsys):
    assert main(["bench", "--agent", str(tmp_path / "none.jsonl")]) == 2
    assert "no session" in capsys.readouterr().err
    path = tmp_path / "s.jsonl"
    path.write_text("")
    assert main(["bench", "--agent", str(path), "--sessions", "0"]) == 2
