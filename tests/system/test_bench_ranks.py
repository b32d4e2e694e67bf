"""``tierchat bench --ranks N``: the bench's servers under ``mlx.launch -n N`` on this host
(the ring backend here; NCCL on GPUs), and how a launched server is stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rank_kit import free_base_port, start_ranks
from tierchat.cli.bench.clients import MLX_LM, TIERCHAT, clients_bench
from tierchat.cli.bench.ranked import Ranks, exit_trouble, rank_pid, rank_tier_use, stop_ranks
from tierchat.cli.common import CLIError
from tierchat.cli.main import main
from tierchat.config.settings import Settings

pytestmark = pytest.mark.system

# rank 0 writes a file on SIGTERM and exits; rank 1 ignores SIGTERM (as a worker blocked in
# a collective would not end on rank 0's signal) until its group is killed
RANK_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
rank = os.environ["MLX_RANK"]
def on_term(*_):
    # rank 0 notes whether the others had their SIGTERM already (they must not have)
    others = sorted(p.name for p in out.glob("term-*"))
    (out / f"term-{rank}").write_text(" ".join(others))
    if rank == "0":
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
(out / f"up-{rank}").write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


def _wait_for(pred, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_launched_server_stops_rank_0_by_sigterm_then_the_rest_of_its_group(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    ranks = Ranks(2, "ring", free_base_port(2))
    cmd = ranks.wrap([sys.executable, str(script), str(tmp_path)])
    assert cmd[1:3] == ["-n", "2"] and "--" in cmd
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    _wait_for(lambda: (tmp_path / "up-0").exists() and (tmp_path / "up-1").exists())
    pids = [int((tmp_path / f"up-{r}").read_text()) for r in (0, 1)]
    assert rank_pid(proc.pid, 0) == pids[0] and rank_pid(proc.pid, 1) == pids[1]
    stop_ranks(proc, timeout_s=60, grace_s=1)
    assert proc.returncode is not None
    # rank 0 got the first SIGTERM (it flushes and tells the workers to end); the rest of
    # the group got one later, and the one that ignored it was killed
    assert (tmp_path / "term-0").read_text() == ""  # nobody else was signalled before it
    assert (tmp_path / "term-1").exists()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_both_servers_run_on_two_ranks_and_each_rank_keeps_its_own_tier(tmp_path, models_dir):
    logs: list[str] = []
    settings = Settings(
        model="tiny:llama",
        models_dir=models_dir,
        cache_dir=tmp_path / "kv",
        data_dir=tmp_path / "data",
        block_size=16,
        hot_bytes=256 << 20,
    )
    got = clients_bench(
        settings,
        [2],
        system_tokens=120,
        turn_tokens=20,
        max_tokens=6,
        log=logs.append,
        ranks=Ranks(2, "ring", free_base_port(2)),
    )
    assert [(r.server, r.clients) for r in got.rounds] == [(TIERCHAT, 2), (MLX_LM, 2)]
    for r in got.rounds:
        assert all(q.completion_tokens > 0 for q in r.requests), r.server
    # the second turn of each client reused the shared prefix on tierchat's ranks
    ours = got.rounds[0].requests
    assert all(q.cached_tokens > 0 for q in ours if q.turn > 0)
    line = next(x for x in logs if "SSD tier per rank" in x)
    assert "rank0-of-2" in line and "rank1-of-2" in line, line


def test_rank_tier_use_lists_each_rank_dir_in_rank_order(tmp_path):
    for r in (10, 2, 0):
        d = tmp_path / f"rank{r}-of-11" / "x"
        d.mkdir(parents=True)
        (d / "a.bin").write_bytes(b"\0" * (r + 1))
    assert rank_tier_use(tmp_path) == [
        ("rank0-of-11", 1, 1),
        ("rank2-of-11", 1, 3),
        ("rank10-of-11", 1, 11),
    ]
    assert rank_tier_use(tmp_path / "none") == []


def test_ranks_outside_the_server_benches_is_a_usage_error(capsys):
    assert main(["bench", "--model", "tiny:llama", "--ranks", "2"]) == 2
    assert "--ranks runs the servers" in capsys.readouterr().err
    with pytest.raises(CLIError, match="expected 1 to 16"):
        Ranks(0)


def test_exit_trouble_finds_what_ranks_said_of_a_failure_since_the_start(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("old run: NCCL error before\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("loaded\n\x1b[33m[WARN] Node with rank 1 exited with code 1 \x1b[0m\n")
        f.write("NCCL error in: x.cu:12, unhandled cuda error\nbye\n")
    assert exit_trouble(log, start) == [
        "[WARN] Node with rank 1 exited with code 1",
        "NCCL error in: x.cu:12, unhandled cuda error",
    ]
    assert exit_trouble(tmp_path / "missing.log", 0) == []


def test_the_workload_bench_runs_on_rank_0_across_ranks_without_the_in_process_baseline(
    tmp_path, models_dir
):
    argv = ["bench", "--workload", "chat-ci", "--model", "tiny:llama"]
    argv += ["--models-dir", str(models_dir), "--cache-dir", str(tmp_path / "kv")]
    refused = start_ranks(argv, tmp_path).wait()
    assert [code for code, _, _ in refused] == [2, 0], refused
    assert "in-process baseline cannot run" in refused[0][2]
    done = start_ranks([*argv, "--no-baseline"], tmp_path).wait()
    assert [code for code, _, _ in done] == [0, 0], [err[-2000:] for _, _, err in done]
    table = done[0][1]
    assert "regenerate" in table and "all                   12" in table, table
