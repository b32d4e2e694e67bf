"""``tierchat bench --serve --clients``: N concurrent streaming clients through tierchat
serve and mlx_lm.server (a subprocess on 127.0.0.1), on a tiny model. No speed asserts:
what the bench counts, and what each client sent and got back."""

from __future__ import annotations

import json

import pytest
from tierchat.cli.bench.clients import (
    MLX_LM,
    TIERCHAT,
    TURNS,
    clients_bench,
    format_summary,
    parse_counts,
    summarize,
)
from tierchat.cli.common import CLIError
from tierchat.cli.main import main
from tierchat.config.settings import Settings

BLOCK = 16


def settings(model: str, tmp_path, models_dir) -> Settings:
    return Settings(
        model=model,
        models_dir=models_dir,
        cache_dir=tmp_path / "kv",
        data_dir=tmp_path / "data",
        block_size=BLOCK,
        hot_bytes=256 << 20,
    )


def test_one_and_two_clients_on_both_servers(tmp_path, models_dir):
    logs: list[str] = []
    got = clients_bench(
        settings("tiny:llama", tmp_path, models_dir),
        [1, 2],
        system_tokens=120,
        turn_tokens=20,
        max_tokens=6,
        log=logs.append,
    )
    # each server first ran an unreported round of the most clients (kernel builds)
    warm = [line for line in logs if "warm-up round of 2 clients" in line]
    assert [line.split(":")[0] for line in warm] == [TIERCHAT, MLX_LM]
    assert [(r.server, r.clients) for r in got.rounds] == [
        (TIERCHAT, 1),
        (TIERCHAT, 2),
        (MLX_LM, 1),
        (MLX_LM, 2),
    ]
    first_prompts = {}
    for r in got.rounds:
        # every client ran its turns in order, each streamed a reply
        assert [(q.client, q.turn) for q in r.requests] == [
            (c, t) for c in range(r.clients) for t in range(TURNS)
        ]
        assert all(q.completion_tokens >= 1 for q in r.requests)
        assert all(0 < q.ttft_s <= q.done_s - q.sent_s for q in r.requests)
        assert r.wall_s == max(q.done_s for q in r.requests)
        assert r.tokens_per_s == sum(q.completion_tokens for q in r.requests) / r.wall_s
        # every first-turn prompt of a round has its own length
        first = [q.prompt_tokens for q in r.requests if q.turn == 0]
        assert len(set(first)) == len(first)
        first_prompts[r.server, r.clients] = first
        for c in range(r.clients):
            one, two = (q for q in r.requests if q.client == c)
            # the second turn carries the first prompt and its own reply, and reuses the
            # first prompt from the server's cache (at least its full blocks)
            assert two.prompt_tokens > one.prompt_tokens + one.completion_tokens
            assert two.cached_tokens >= one.prompt_tokens // BLOCK * BLOCK
    # both servers got the same first turns (same chat template, same text)
    for n in (1, 2):
        assert first_prompts[TIERCHAT, n] == first_prompts[MLX_LM, n]
    summary = summarize(got.rounds)
    assert [e["clients"] for e in summary] == [1, 2]
    for e in summary:
        assert e["tokens_ratio"] == e[TIERCHAT]["tokens_per_s"] / e[MLX_LM]["tokens_per_s"]
        assert e["ttft_p90_ratio"] == e[TIERCHAT]["ttft_p90_s"] / e[MLX_LM]["ttft_p90_s"]
        assert e[TIERCHAT]["requests"] == e[MLX_LM]["requests"] == TURNS * e["clients"]
    lines = format_summary(summary).splitlines()
    assert len(lines) == 1 + 2 and "p90 tc/mlx" in lines[0]


def test_command_without_baseline_writes_json(tmp_path, models_dir, isolated_settings, capsys):
    out = tmp_path / "clients.json"
    code = main(
        [
            "bench",
            "--serve",
            "--clients",
            "2",
            "--no-baseline",
            "--system-tokens",
            "64",
            "--turn-tokens",
            "8",
            "--max-tokens",
            "4",
            "--model",
            "tiny:qwen2",
            "--models-dir",
            str(models_dir),
            "--cache-dir",
            str(tmp_path / "kv"),
            "--data-dir",
            str(tmp_path / "data"),
            "--json",
            str(out),
            "--fresh-kernel-cache",
            "--no-warm-round",
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["clients"] == [2] and doc["max_tokens"] == 4
    (entry,) = doc["summary"]
    assert entry[TIERCHAT]["requests"] == 4 and MLX_LM not in entry
    assert entry["tokens_ratio"] is None
    (r,) = doc["rounds"]
    assert len(r["rows"]) == 4
    got = capsys.readouterr()
    assert "clients" in got.out
    # the server ran with a kernel cache of its own, and no warm-up round
    assert f"{TIERCHAT}: kernels in " in got.err and "warm-up round" not in got.err


@pytest.mark.parametrize("text", ["0", "1,x", "", "65"])
def test_bad_client_counts(text):
    with pytest.raises(CLIError):
        parse_counts(text)


def test_clients_needs_serve(isolated_settings, capsys):
    assert main(["bench", "--clients", "4", "--model", "tiny:llama"]) == 2
    assert "--clients needs --serve" in capsys.readouterr().err
