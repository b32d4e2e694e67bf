"""One model across 2 ranks (issue 20): MLX's ring backend on this machine.

Each rank is a real process (``tests/rank_kit.py``), tierchat's own entry point, a tiny
model sharded over both ranks, and a prefix cache per rank. What must hold:

- a replay's tokens with the cache equal the same 2-rank replay with ``--no-cache``;
- a restart restores from the SSD tier on both ranks;
- a file lost on one rank only: the request falls back and still equals the cold run;
- a rank killed or stopped mid-request: rank 0 errors out within the timeout;
- ``cache clear`` clears every rank; ``--hostfile`` goes through ``mlx.launch``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rank_kit import (
    TIMEOUT_S,
    base_env,
    free_base_port,
    localhost_hostfile,
    results,
    start_ranks,
)

ARCHS = ("llama", "qwen2", "qwen3_5")

SCRIPT = [
    {"op": "new", "system": "You are terse."},
    {
        "op": "user",
        "text": "Hello there, how are you doing today? Tell me of caches.",
        "max_tokens": 6,
    },
    {"op": "user", "text": "A second question, about prefix reuse across turns.", "max_tokens": 6},
    {"op": "regenerate", "max_tokens": 6},
    {"op": "edit", "turn": 0, "text": "Hello there, something else entirely.", "max_tokens": 6},
    {"op": "restart"},
    {"op": "user", "text": "After the restart, go on please.", "max_tokens": 6},
]
ONE_TURN = [
    {"op": "new", "system": "You are terse."},
    {
        "op": "user",
        "text": "Hello there, how are you doing today? Tell me of caches.",
        "max_tokens": 6,
    },
]


def write(path: Path, ops: list[dict]) -> str:
    path.write_text("".join(json.dumps(op) + "\n" for op in ops))
    return str(path)


def flags(arch: str, cache_dir: Path, models_dir: Path) -> list[str]:
    return [
        "--model",
        f"tiny:{arch}",
        "--block-size",
        "16",
        "--cache-dir",
        str(cache_dir),
        "--models-dir",
        str(models_dir),
        "--rank-timeout",
        "60",
    ]


def replay(tmp_path: Path, ops: list[dict], argv: list[str], **env) -> tuple[list[dict], dict]:
    """Run a replay as 2 ranks; both exit 0, rank 0 prints no error."""
    script = write(tmp_path / f"s{len(list(tmp_path.glob('s*.jsonl')))}.jsonl", ops)
    ranks = start_ranks(["replay", script, *argv], tmp_path, **env)
    try:
        (code0, out0, err0), (code1, out1, err1) = ranks.wait()
    finally:
        ranks.kill()
    assert (code0, code1) == (0, 0), (err0, err1)
    assert "Traceback" not in err0 + err1 and out1 == ""
    return results(out0)


def shas(ops: list[dict]) -> list[tuple[int, str]]:
    return [(x["op_index"], x["token_ids_sha256"]) for x in ops]


def rank_dirs(cache_dir: Path) -> list[Path]:
    """Each rank's SSD directory, by rank: ``<cache_dir>/rank<R>-of-2/<fingerprint[:16]>``."""
    dirs = [[p for p in (cache_dir / f"rank{r}-of-2").iterdir() if p.is_dir()] for r in range(2)]
    assert [len(d) for d in dirs] == [1, 1], dirs  # one layout, one model: one dir each
    return [d[0] for d in dirs]


def header(path: Path) -> dict:
    """The ``__metadata__`` of one SSD entry file (safetensors: u64 length, JSON)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))["__metadata__"]


# ------------------------------------------------------------------ exactness


# bit for bit by construction: the bitwise schedule (docs/DESIGN.md §18) restores only
# where a cold run's chunk ends, so the rest is computed in the cold run's chunks
BITWISE = {"TIERCHAT_BITWISE": "true"}


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_replay_equals_no_cache_on_two_ranks(tmp_path, models_dir, arch):
    argv = flags(arch, tmp_path / "kv", models_dir)
    cached, summary = replay(tmp_path, SCRIPT, argv, **BITWISE)
    cold, _ = replay(tmp_path, SCRIPT, [*argv, "--no-cache"], **BITWISE)
    assert shas(cached) == shas(cold)
    assert len(cached) == 5
    by_op = {x["op_index"]: x for x in cached}
    assert by_op[2]["cached_tokens"] > 0 and by_op[3]["cached_tokens"] > 0
    # the regenerate: attention models take its first token from the kept logprobs
    assert by_op[3]["prefill_tokens"] == (1 if arch == "qwen3_5" else 0)
    assert all(x["cached_tokens"] == 0 for x in cold)
    # the op after the restart: from the SSD tier, on both ranks alike
    assert by_op[6]["cached_by"]["ssd"] > 0
    ranks = summary["cache"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["cached_ssd"] == ranks[1]["cached_ssd"] == by_op[6]["cached_by"]["ssd"]
    assert all(r["ssd_entries"] > 0 and r["hot_entries"] > 0 for r in ranks)
    # one SSD directory per rank, each keyed by its layout
    assert len({d.name for d in rank_dirs(tmp_path / "kv")}) == 2


# ------------------------------------------------------------------ SSD tier, lost files


@pytest.mark.parametrize("arch", ARCHS)
def test_restart_restores_from_ssd_and_a_lost_file_falls_back(tmp_path, models_dir, arch):
    kv = tmp_path / "kv"
    argv = flags(arch, kv, models_dir)
    (first,), _ = replay(tmp_path, ONE_TURN, argv, **BITWISE)
    assert first["cached_tokens"] == 0
    # a new process on the same cache: the same prompt again comes from SSD on both ranks
    (again,), summary = replay(tmp_path, ONE_TURN, argv, **BITWISE)
    n = again["prompt_tokens"]
    assert again["cached_tokens"] == again["cached_by"]["ssd"] == n - 1
    assert [r["cached_ssd"] for r in summary["cache"]["ranks"]] == [n - 1, n - 1]
    assert again["token_ids_sha256"] == first["token_ids_sha256"]
    # one rank loses every file after the prompt's last full block (the block of prompt +
    # reply that starts with the prompt's last tokens): the ranks fall back together
    last_block = (n - 1) // 16 * 16
    lost = [
        f for f in rank_dirs(kv)[1].rglob("*.safetensors") if int(header(f)["start"]) == last_block
    ]
    # (the prompt's tail is covered by the sequence end after the same block, so admission
    # by reuse writes only the longer entry: docs/DESIGN.md §8.6)
    assert lost and "block" in {header(f)["kind"] for f in lost}
    for f in lost:
        f.unlink()
    (after,), summary = replay(tmp_path, ONE_TURN, argv, **BITWISE)
    assert 0 < after["cached_tokens"] < n - 1  # the longest prefix both ranks still hold
    assert after["token_ids_sha256"] == first["token_ids_sha256"]
    cached = [(r["cached_hot"], r["cached_ssd"]) for r in summary["cache"]["ranks"]]
    assert cached[0] == cached[1]


def test_cache_clear_clears_every_rank(tmp_path, models_dir):
    kv = tmp_path / "kv"
    argv = flags("llama", kv, models_dir)
    replay(tmp_path, ONE_TURN, argv)
    assert all(any(d.rglob("*.safetensors")) for d in rank_dirs(kv))
    ranks = start_ranks(["cache", "clear", "ssd", *argv], tmp_path)
    try:
        (code0, out0, err0), (code1, out1, err1) = ranks.wait()
    finally:
        ranks.kill()
    assert (code0, code1) == (0, 0), (err0, err1)
    assert "Cleared ssd: SSD −" in out0  # the one clear report (core/live_status.py)
    assert [list(d.rglob("*.safetensors")) for d in rank_dirs(kv)] == [[], []]


# ------------------------------------------------------------------ faults


def _first_result_then(tmp_path, models_dir, signals: list[signal.Signals], timeout_s: float):
    """Start a long replay; when its first reply is out, send ``signals`` to rank 1 (0.5 s
    apart); return rank 0's exit code, stderr and the seconds it took to end after."""
    ops = [*ONE_TURN] + [
        {"op": "user", "text": f"Turn {i}, go on.", "max_tokens": 6} for i in range(30)
    ]
    script = write(tmp_path / "long.jsonl", ops)
    argv = flags("llama", tmp_path / "kv", models_dir)
    argv[argv.index("--rank-timeout") + 1] = str(timeout_s)
    ranks = start_ranks(["replay", script, *argv], tmp_path)
    rank0, rank1 = ranks.procs
    try:
        line = rank0.stdout.readline()
        assert '"op_index": 1' in line, rank0.stderr.read() if not line else line
        for i, sig in enumerate(signals):
            if i:
                time.sleep(0.5)
            rank1.send_signal(sig)
        t0 = time.monotonic()
        out, err = rank0.communicate(timeout=timeout_s + 60)
        return rank0.returncode, out, err, time.monotonic() - t0
    finally:
        ranks.kill()


def test_worker_killed_mid_request_fails_rank_0(tmp_path, models_dir):
    """Rank 1 stopped (rank 0 now waits for it inside the next request), then killed:
    rank 0 reports the lost rank, long before its timeout, and exits 1."""
    code, out, err, took = _first_result_then(
        tmp_path, models_dir, [signal.SIGSTOP, signal.SIGKILL], timeout_s=60
    )
    assert code == 1
    assert "a rank was lost" in err
    assert took < 30
    assert "Traceback" not in err
    ops, _ = results(out)  # the client's error is the README's words, not the backend's
    failed = [x["error"] for x in ops if "error" in x]
    assert failed and all("a rank was lost" in e for e in failed), failed
    assert not any(e.startswith("RuntimeError") for e in failed)


def test_worker_that_stops_answering_fails_rank_0_within_the_timeout(tmp_path, models_dir):
    code, out, err, took = _first_result_then(tmp_path, models_dir, [signal.SIGSTOP], 5)
    assert code == 1
    assert "a rank stopped answering" in err and "timeout 5 s" in err
    assert took < 5 + 20
    ops, _ = results(out)
    assert ops and all("stopped answering" in x["error"] for x in ops)  # no reply after


# ------------------------------------------------------------------ launch


def test_hostfile_runs_through_mlx_launch(tmp_path, models_dir):
    """``tierchat --hostfile`` re-executes itself through mlx.launch: 2 ranks, rank 0's
    output; the same tokens as the 2-rank run started by hand."""
    hostfile = localhost_hostfile(tmp_path)
    argv = flags("qwen2", tmp_path / "kv", models_dir)
    script = write(tmp_path / "one.jsonl", ONE_TURN)
    port = free_base_port(2)
    cmd = [sys.executable, "-m", "tierchat.cli.main", "--hostfile", str(hostfile)]
    cmd += ["--starting-port", str(port), "replay", script, *argv]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=base_env(tmp_path), timeout=TIMEOUT_S
    )
    (launched,), summary = results(proc.stdout)
    assert len(summary["cache"]["ranks"]) == 2, proc.stderr
    (by_hand,), _ = replay(tmp_path, ONE_TURN, [*argv, "--no-cache"])
    assert launched["token_ids_sha256"] == by_hand["token_ids_sha256"]


def test_launch_argv(tmp_path):
    from tierchat.cli.ranks import launch_argv

    hostfile = localhost_hostfile(tmp_path)
    cmd = launch_argv(["serve", "--model", "tiny:llama"], str(hostfile), "ring", 40000)
    assert Path(cmd[0]).name == "mlx.launch"
    sep = cmd.index("--")
    assert cmd[1:sep] == [
        "--hostfile",
        str(hostfile),
        "--backend",
        "ring",
        "--starting-port",
        "40000",
    ]
    assert cmd[sep + 1 :] == [
        sys.executable,
        "-m",
        "tierchat.cli.main",
        "serve",
        "--model",
        "tiny:llama",
    ]


def test_tui_is_refused_across_ranks(tmp_path, models_dir):
    ranks = start_ranks(flags("llama", tmp_path / "kv", models_dir), tmp_path)
    try:
        (code0, _, err0), (code1, _, _) = ranks.wait()
    finally:
        ranks.kill()
    assert code0 == 2 and "the TUI needs a terminal" in err0
    assert code1 == 0  # the worker ends with rank 0


# ------------------------------------------------------------------ the TUI on rank 0


def test_tui_runs_on_rank_0_in_its_terminal(tmp_path, models_dir):
    """``tierchat --hostfile`` with no command: this process is rank 0 and keeps its
    terminal (a pty here), the worker is started beside it; a message typed as bytes gets
    a reply, the ranks panel shows both ranks, and Ctrl+Q ends both processes."""
    import fcntl
    import os
    import pty
    import sqlite3
    import struct
    import termios

    hostfile = localhost_hostfile(tmp_path)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = base_env(tmp_path) | {"TERM": "xterm-256color", "TMPDIR": str(tmp_path)}
    argv = ["--hostfile", str(hostfile), "--starting-port", str(free_base_port(2))]
    argv += flags("llama", tmp_path / "kv", models_dir)
    argv += ["--data-dir", str(tmp_path / "data"), "--max-tokens", "4"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierchat.cli.main", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    screen = bytearray()

    def read_until(pred, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            try:
                screen.extend(os.read(master, 65536))
            except (BlockingIOError, OSError):
                time.sleep(0.05)
        raise AssertionError(f"no {what}: {bytes(screen[-2000:])!r}")

    def replies() -> int:
        db = tmp_path / "data" / "conversations.sqlite"
        if not db.exists():
            return 0
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            return conn.execute("SELECT count(*) FROM nodes WHERE role='assistant'").fetchone()[0]

    os.set_blocking(master, False)
    logs = []
    try:
        read_until(lambda: b"cache on" in screen, "the model loaded on both ranks")
        os.write(master, b"hello ranks\r")
        read_until(lambda: replies() == 1, "reply")
        read_until(lambda: b"Ranks (2)" in screen, "ranks panel")
        os.write(master, b"\x11")  # ctrl+q
        read_until(lambda: proc.poll() is not None, "exit", timeout=60)  # reading: no stall
        logs = list(tmp_path.glob("tierchat-ranks-*/rank1.log"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        os.close(master)
    assert proc.returncode == 0
    assert len(logs) == 1 and "Traceback" not in logs[0].read_text()


# ------------------------------------------------------------------ cancel

DRIVER = """
import json, sys
from tierchat.config.settings import Settings
from tierchat.core.engine import distributed as dist
from tierchat.core.api import Failed, GenerateRequest, PrefillProgress, TokenBatch
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.engine.engine import Engine

cache_dir, models_dir = sys.argv[1], sys.argv[2]
s = Settings(model="tiny:llama", cache_dir=cache_dir, models_dir=models_dir, block_size=16,
             prefill_chunk=16)
e = Engine(s)
assert not isinstance(e.load_model("tiny:llama").wait(), Failed)
out = {}

def run(name, req, cancel_on=None):
    box = []
    def on_event(ev):
        if cancel_on is not None and isinstance(ev, cancel_on):
            box.append(ev)
            if len(box) == 2:
                h.cancel()
    h = e.submit(req, on_event=on_event)
    r = h.wait(120)
    out[name] = {"type": type(r).__name__, "kind": getattr(r, "kind", ""),
                 "tokens": list(getattr(r, "token_ids", ())),
                 "reason": getattr(getattr(r, "metrics", None), "finish_reason", ""),
                 "cached": getattr(getattr(r, "metrics", None), "cached_tokens", 0)}

long = tuple(range(1, 120))
teach = tuple(range(40, 140))
run("decode", GenerateRequest(long, teacher_ids=teach), cancel_on=TokenBatch)
ids = tuple(range(2, 200))
run("prefill", GenerateRequest(ids, SamplingParams(max_tokens=4)), cancel_on=PrefillProgress)
run("after", GenerateRequest(ids, SamplingParams(max_tokens=6)))
run("cold", GenerateRequest(ids, SamplingParams(max_tokens=6), use_cache=False))
e.close()
dist.current().broadcast({"op": "exit"})
print(json.dumps(out))
"""


def test_rank_0_cancel_reaches_the_worker(tmp_path, models_dir):
    """Rank 0 cancels one request in decode and one in prefill: the worker stops with it
    (the next requests run in step on both ranks) and the next request still equals a
    cold one."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    kv = tmp_path / "kv"
    worker = ["cache", "stats", "--block-size", "16", "--prefill-chunk", "16"]
    worker += ["--cache-dir", str(kv), "--models-dir", str(models_dir)]
    ranks = start_ranks(worker, tmp_path, rank0=[str(driver), str(kv), str(models_dir)])
    try:
        (code0, out0, err0), (code1, _, err1) = ranks.wait()
    finally:
        ranks.kill()
    assert (code0, code1) == (0, 0), (err0, err1)
    out = json.loads(out0.strip().splitlines()[-1])
    decode = out["decode"]
    assert decode["type"] == "Finished" and decode["reason"] == "cancelled"
    assert 2 <= len(decode["tokens"]) < 100
    assert out["prefill"]["type"] == "Failed" and out["prefill"]["kind"] == "cancelled"
    assert out["after"]["type"] == out["cold"]["type"] == "Finished"
    assert out["after"]["cached"] > 0  # the chunks kept from the cancelled prefill
    assert out["after"]["tokens"] == out["cold"]["tokens"]


BATCH_DRIVER = """
import json, sys, threading
from tierchat.config.settings import Settings
from tierchat.core.engine import distributed as dist
from tierchat.core.api import Failed, GenerateRequest
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.engine.engine import Engine

cache_dir, models_dir, model, chunk = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
s = Settings(model=model, cache_dir=cache_dir, models_dir=models_dir, block_size=16,
             prefill_chunk=chunk)
e = Engine(s)
assert not isinstance(e.load_model(model).wait(), Failed)
shared = tuple(range(3, 43))
prompts = [shared + (7, 9, 11), tuple(range(50, 121)), (5, 6, 7, 8, 9), shared + tuple(range(90, 120))]
six, two = SamplingParams(max_tokens=6), SamplingParams(max_tokens=2)
alone = [e.submit(GenerateRequest(p, six, use_cache=False)).wait(120) for p in prompts]
e.submit(GenerateRequest(shared + (1, 1), two)).wait(120)  # the shared prefix, cached
gate, started = threading.Event(), threading.Event()
def block():
    started.set()
    gate.wait(120)
hold = threading.Thread(target=e.call, args=(block, 180))
hold.start()
assert started.wait(120)
handles = [e.submit(GenerateRequest(p, six)) for p in prompts]  # admitted together
gate.set()
hold.join(120)
batched = [h.wait(120) for h in handles]
out = {
    "alone": [list(getattr(r, "token_ids", ())) for r in alone],
    "batched": [list(getattr(r, "token_ids", ())) for r in batched],
    "types": [type(r).__name__ for r in alone + batched],
    "cached": [r.metrics.cached_tokens for r in batched if hasattr(r, "metrics")],
    "peak_merged": e.executor.batch.peak_merged if e.executor.batch is not None else 0,
    "peak_group": e.executor.peak_group,
}
e.close()
dist.current().broadcast({"op": "exit"})
print(json.dumps(out))
"""


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_next"])
def test_requests_batch_across_ranks_and_equal_each_alone(tmp_path, models_dir, arch):
    """Four requests admitted together on 2 ranks decode in one batch (every rank's
    scheduler takes rank 0's steps; the rests of the short prompts are prefilled in one
    forward, tensor parallel on llama and qwen3_5, pipeline on qwen3_next) and give the tokens of each
    run alone and cold."""
    driver = tmp_path / "driver.py"
    driver.write_text(BATCH_DRIVER)
    kv = tmp_path / "kv"
    # 16-token chunks: the hybrid's checkpoints fall inside the shared prefix; 64: the
    # attention model's rests fit one group
    chunk = "64" if arch == "llama" else "16"
    worker = ["cache", "stats", "--block-size", "16", "--prefill-chunk", chunk]
    worker += ["--cache-dir", str(kv), "--models-dir", str(models_dir)]
    rank0 = [str(driver), str(kv), str(models_dir), f"tiny:{arch}", chunk]
    ranks = start_ranks(worker, tmp_path, rank0=rank0)
    try:
        (code0, out0, err0), (code1, _, err1) = ranks.wait()
    finally:
        ranks.kill()
    assert (code0, code1) == (0, 0), (err0, err1)
    out = json.loads(out0.strip().splitlines()[-1])
    assert set(out["types"]) == {"Finished"}
    assert out["batched"] == out["alone"]
    assert out["peak_merged"] >= 2  # they decoded in one batch
    assert max(out["cached"]) > 0  # one restored the shared prefix on both ranks
    assert out["peak_group"] >= 2  # rests prefilled together on both ranks


def test_cache_stats_table_has_a_block_of_rows_per_rank():
    from tierchat.cli.cache_cmd import stats_rows
    from tierchat.core.api import CacheStats, RankStats, plain

    stats = CacheStats(ranks=(RankStats(rank=0, hot_bytes=5120), RankStats(rank=1, ssd_entries=3)))
    for form in (stats, plain(stats)):  # this process's snapshot, or a running app's JSON
        rows = dict(stats_rows(form))
        assert rows["ranks.0.hot_bytes"] == "5.0 KiB" and rows["ranks.1.ssd_entries"] == 3
        assert rows["ranks.1.memory_level"] == "ok"


def test_a_model_with_neither_shard_nor_pipeline_is_refused_on_every_rank(tmp_path, models_dir):
    script = write(tmp_path / "one.jsonl", ONE_TURN)
    ranks = start_ranks(["replay", script, *flags("mamba2", tmp_path / "kv", models_dir)], tmp_path)
    try:
        (code0, _, err0), (code1, _, err1) = ranks.wait()
    finally:
        ranks.kill()
    assert code0 == 1 and "cannot run across 2 ranks" in err0 and "neither shard" in err0
    assert code1 == 0, err1  # the worker refused the same load and ended with rank 0


def test_layout_is_part_of_the_cache_key():
    """Rank, world size and mode salt the fingerprint the SSD directory is named from: a
    restart with another layout never reads these files."""
    from tierchat.core.models.loading import layout_fingerprint

    keys = {
        layout_fingerprint("f" * 64, mode, rank, size)
        for mode in ("tensor", "pipeline")
        for size in (2, 4)
        for rank in range(size)
    }
    assert len(keys) == 2 * (2 + 4)
    assert "f" * 64 not in keys


def test_serve_on_two_ranks(tmp_path, models_dir):
    """``tierchat serve`` on rank 0, a worker beside it: the second turn of a chat comes
    from the cache, and Ctrl-C ends both ranks cleanly."""
    import urllib.request

    from rank_kit import free_ports

    port = free_ports(1)[0]
    argv = ["serve", "--port", str(port), *flags("qwen2", tmp_path / "kv", models_dir)]
    ranks = start_ranks([*argv, "--data-dir", str(tmp_path / "data")], tmp_path)
    base = f"http://127.0.0.1:{port}"

    def ask(messages: list[dict]) -> dict:
        body = json.dumps({"model": "x", "messages": messages, "max_tokens": 6}).encode()
        req = urllib.request.Request(
            f"{base}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        return json.loads(urllib.request.urlopen(req, timeout=120).read())

    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline and ranks.procs[0].poll() is None
                time.sleep(0.3)
        chat = [{"role": "user", "content": "Hello there, tell me about prefix caches."}]
        first = ask(chat)
        chat += [first["choices"][0]["message"], {"role": "user", "content": "And more?"}]
        second = ask(chat)
        ranks.procs[0].send_signal(signal.SIGINT)
        codes = [code for code, _, _ in ranks.wait()]
    finally:
        ranks.kill()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert codes == [0, 0]


def test_a_restart_with_fewer_ranks_does_not_load_the_other_layout(tmp_path, models_dir):
    kv = tmp_path / "kv"
    argv = flags("llama", kv, models_dir)
    (two,), _ = replay(tmp_path, ONE_TURN, argv)
    script = write(tmp_path / "alone.jsonl", ONE_TURN)
    proc = subprocess.run(
        [sys.executable, "-m", "tierchat.cli.main", "replay", script, *argv],
        capture_output=True,
        text=True,
        env=base_env(tmp_path),
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    (alone,), summary = results(proc.stdout)
    assert alone["cached_tokens"] == 0  # the same prompt, but only the 2-rank files hold it
    assert summary["cache"]["ranks"] == []
    rank_dirs(kv)  # the 2-rank files are where they were
    alone_dirs = [p for p in kv.iterdir() if p.is_dir() and not p.name.startswith("rank")]
    assert len(alone_dirs) == 1  # one rank alone: its own directory


@pytest.mark.parametrize("arch", ("qwen2", "qwen3_5"))
def test_pipeline_sharding_equals_no_cache(tmp_path, models_dir, arch):
    """``TIERCHAT_SHARD=pipeline``: consecutive layers per rank (mlx-lm's pipeline), each
    rank caching its own layers; the same tokens with and without the cache."""
    argv = flags(arch, tmp_path / "kv", models_dir)
    env = {**BITWISE, "TIERCHAT_SHARD": "pipeline"}
    cached, summary = replay(tmp_path, SCRIPT, argv, **env)
    cold, _ = replay(tmp_path, SCRIPT, [*argv, "--no-cache"], **env)
    assert shas(cached) == shas(cold)
    assert {x["op_index"]: x for x in cached}[6]["cached_by"]["ssd"] > 0
    layers = summary["cache"]["layer_kinds"]
    total = {"qwen2": 2, "qwen3_5": 4}[arch]
    assert 0 < len(layers) < total  # this rank's layers only
