"""Run tierchat as 2 ranks on this machine over MLX's ring backend (tests of issue 20).

:func:`start_ranks` starts one process per rank with the variables ``mlx.launch`` sets
(``MLX_RANK``, ``MLX_HOSTFILE`` with a ring of free localhost ports), so a test can stop
or kill one rank; :func:`mlx_launch` goes through ``mlx.launch`` itself. Every process is
killed at the end of the test that started it, and every wait has a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 240  # one 2-rank run on 2 busy CPU cores: imports, tiny model, a few ops


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def free_base_port(n: int) -> int:
    """A port ``p`` with ``p .. p + n - 1`` free (mlx.launch's --starting-port)."""
    for _ in range(50):
        base = free_ports(1)[0]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError("no run of free ports")


def base_env(tmp_path: Path) -> dict[str, str]:
    """This environment without TIERCHAT_* (but the models dir) or a launcher's rank."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("TIERCHAT_") or k.startswith("MLX_")) or k == "TIERCHAT_MODELS_DIR"
    }
    config = tmp_path / "empty.toml"
    config.write_text("")
    env["TIERCHAT_CONFIG"] = str(config)
    return env


@dataclass
class Ranks:
    procs: list[subprocess.Popen]

    def wait(self, timeout: float = TIMEOUT_S) -> list[tuple[int, str, str]]:
        """``(exit code, stdout, stderr)`` of every rank."""
        out = []
        for p in self.procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                except ProcessLookupError:
                    pass
                p.wait(30)


def start_ranks(
    argv: list[str], tmp_path: Path, n: int = 2, rank0: list[str] | None = None, **env_extra
) -> Ranks:
    """``tierchat ARGV`` as ``n`` ranks of one ring (this machine, free ports); rank 0
    runs ``python RANK0...`` instead when given (a driver script)."""
    ring = [[f"127.0.0.1:{p}"] for p in free_ports(n)]
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps(ring))
    procs = []
    for rank in range(n):
        env = base_env(tmp_path) | {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        env |= {k: str(v) for k, v in env_extra.items()}
        cmd = [sys.executable, "-m", "tierchat.cli.main", *argv]
        if rank == 0 and rank0 is not None:
            cmd = [sys.executable, *rank0]
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                env=env,
            )
        )
    return Ranks(procs)


def localhost_hostfile(tmp_path: Path, n: int = 2) -> Path:
    """An ``mlx.distributed_config``-style hostfile of ``n`` ranks on this machine."""
    path = tmp_path / "hosts.json"
    hosts = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]} for _ in range(n)]
    path.write_text(json.dumps({"backend": "ring", "hosts": hosts}))
    return path


def results(stdout: str) -> tuple[list[dict], dict]:
    """A replay's result lines (by op) and its summary."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    ops = [x for x in lines if "op_index" in x]
    summary = next((x["summary"] for x in lines if "summary" in x), {})
    return ops, summary
