"""The bench's servers across ranks on this host: ``tierchat bench --ranks N``.

``--serve --clients`` and ``--agent`` start each server as ``mlx.launch -n N [--backend
B] -- COMMAND`` (one process per rank on this host; NCCL with one GPU per rank where MLX
has CUDA, the ring otherwise, as mlx.launch chooses): ``tierchat serve`` shards the model
and keeps a cache dir per rank (docs/DESIGN.md §19), ``mlx_lm.server`` loads with its own
``sharded_load`` (tensor parallel). Rank 0 serves HTTP in both; the figures are rank 0's.

Stopping a launched server is not ``SIGTERM`` to mlx.launch: it would die at once and
leave its ranks behind, writing into a closed pipe. :func:`stop_ranks` sends ``SIGTERM``
to rank 0 (tierchat serve flushes its SSD tier and tells the workers to end, as after
Ctrl-C), waits for the launcher to end, and only then signals the whole process group.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierchat.cli.common import EXIT_USAGE, CLIError
from tierchat.cli.ranks import launcher_path


@dataclass(frozen=True)
class Ranks:
    """How many ranks a bench server runs on (1: a plain process), mlx.launch's
    ``--backend`` (None: its default, NCCL with CUDA, the ring otherwise) and the ring's
    ``--starting-port`` (None: mlx.launch's, 32323)."""

    size: int = 1
    backend: str | None = None
    starting_port: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.size <= 16:
            raise CLIError(f"--ranks {self.size}: expected 1 to 16", EXIT_USAGE)

    @classmethod
    def from_args(cls, args: Any) -> Ranks:
        """From ``tierchat bench``'s ``--ranks`` and the global ``--backend`` and
        ``--starting-port``."""
        return cls(
            getattr(args, "ranks", 1),
            getattr(args, "backend", None),
            getattr(args, "starting_port", None),
        )

    @property
    def launched(self) -> bool:
        return self.size > 1

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as every rank runs it (unchanged for one rank)."""
        if not self.launched:
            return list(cmd)
        head = [launcher_path(), "-n", str(self.size)]
        if self.backend:
            head += ["--backend", self.backend]
        if self.starting_port:
            head += ["--starting-port", str(self.starting_port)]
        return [*head, "--", *cmd]

    def describe(self) -> str:
        return f"{self.size} ranks ({self.backend or 'mlx.launch default backend'})"


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``; [] elsewhere)."""
    out = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces, split after its ')'
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(entry.parent.name))
    return out


def rank_pid(launcher_pid: int, rank: int = 0) -> int | None:
    """The pid of ``rank``'s process among the launcher's children (its ``MLX_RANK``);
    None when it is not (yet, or any longer) running."""
    for pid in _children(launcher_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"MLX_RANK={rank}".encode() in env:
            return pid
    return None


def stop_ranks(proc: subprocess.Popen, timeout_s: float, grace_s: float = 15) -> None:
    """Stop a launched server: ``SIGTERM`` to rank 0, up to ``timeout_s`` for the
    launcher to end with its ranks; then ``SIGTERM`` to the process group (the ranks of a
    server whose workers wait on rank 0 forever, as mlx_lm.server's do), ``grace_s``
    more, then ``SIGKILL``. ``proc`` must have been started in a session of its own.
    Rank 0 is found through Linux's ``/proc``; elsewhere (macOS) the group is signalled
    at once, every rank together."""
    pid = rank_pid(proc.pid)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + (timeout_s if pid is not None else 0)
    while proc.poll() is None and time.monotonic() < deadline:
        if pid is not None and not Path(f"/proc/{pid}").exists():
            # rank 0 has ended: give the other ranks a short while, not the whole timeout
            deadline = min(deadline, time.monotonic() + grace_s)
            pid = None
        time.sleep(0.2)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30)):
        proc.poll()  # reap the launcher: a zombie still counts in its group
        if not _group_alive(proc.pid):
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + wait_s
        while time.monotonic() < end and (proc.poll() is None or _group_alive(proc.pid)):
            time.sleep(0.2)
    proc.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


EXIT_TROUBLE = re.compile(r"NCCL error|exited with code|was killed|Traceback|Segmentation|Abort")
"""Lines of a launched server's output that say a rank did not end cleanly (mlx.launch's
"Node with rank R exited with code C", NCCL's own error lines)."""


def exit_trouble(log_path: Path, offset: int) -> list[str]:
    """The :data:`EXIT_TROUBLE` lines written to ``log_path`` after byte ``offset`` (one
    start and stop of a server), without terminal colour codes."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    lines = (re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in text.splitlines())
    return [line for line in lines if EXIT_TROUBLE.search(line)]


def rank_tier_use(cache_dir: Path) -> list[tuple[str, int, int]]:
    """Each rank's SSD tier under ``cache_dir`` after a run: ``(dir name, files, bytes)``
    per ``rank<R>-of-<N>`` dir (docs/DESIGN.md §19), in rank order; [] for one rank."""
    out = []
    for d in sorted(cache_dir.glob("rank*-of-*"), key=lambda p: int(p.name[4:].split("-")[0])):
        files = [f for f in d.rglob("*") if f.is_file()]
        out.append((d.name, len(files), sum(f.stat().st_size for f in files)))
    return out


def describe_tier_use(cache_dir: Path) -> str | None:
    """One line of :func:`rank_tier_use` (None for one rank)."""
    use = rank_tier_use(cache_dir)
    if not use:
        return None
    return "SSD tier per rank: " + ", ".join(
        f"{name} {n} files {size / 2**20:.1f} MiB" for name, n, size in use
    )
