"""One model across several ranks (docs/DESIGN.md §19): ``--hostfile`` and the workers.

``tierchat --hostfile hosts.json COMMAND ...`` runs ``mlx.launch --hostfile hosts.json --
python -m tierchat.cli.main COMMAND ...`` (the hostfile format ``mlx.distributed_config``
writes; the backend is the hostfile's, else ``--backend``, else mlx.launch's default:
NCCL with CUDA, ring otherwise). The same works by hand: ``mlx.launch ... -- tierchat
serve ...``. In a launched process rank 0 runs the command and every other rank runs
:func:`run_worker`, whatever the command line says: it loads what rank 0 loads and runs
what rank 0 runs, on its own shard, until rank 0 ends.

Rank 0's output is the command's; mlx.launch forwards stdin to every rank (rank 0 reads
it) and prints each rank's output. The TUI needs a terminal, which mlx.launch does not
give rank 0, so ``tierchat --hostfile hosts.json`` without a command keeps this process
as rank 0 and starts the others itself (:func:`start_workers`, ring backend). Each rank
works in its own cache dir (:func:`rank_settings`). docs/DESIGN.md §19.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tierchat.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CLIError

# the launchers' rank variables (core/engine/distributed.py reads them)
RANK_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def launched() -> bool:
    """True in a process that ``mlx.launch`` (or ``mpirun``) started as one of its ranks."""
    return any(os.environ.get(v) for v in RANK_VARS)


def launcher_path() -> str:
    """The ``mlx.launch`` script beside this Python, else the one on ``PATH``.

    Raises:
        CLIError: mlx.launch is not installed.
    """
    here = Path(sys.executable).parent / "mlx.launch"
    found = str(here) if here.exists() else shutil.which("mlx.launch")
    if found is None:
        raise CLIError("mlx.launch is not installed (it comes with mlx)")
    return found


def launch_argv(
    argv: Sequence[str],
    hostfile: str,
    backend: str | None = None,
    starting_port: int | None = None,
) -> list[str]:
    """The ``mlx.launch`` command line that runs ``tierchat ARGV`` on every host of
    ``hostfile`` (with this Python: every host needs tierchat at the same path).

    Raises:
        CLIError: mlx.launch is not installed, or the hostfile does not exist.
    """
    if not Path(hostfile).is_file():
        raise CLIError(f"{hostfile}: no such hostfile", EXIT_USAGE)
    cmd = [launcher_path(), "--hostfile", str(hostfile)]
    if backend:
        cmd += ["--backend", backend]
    if starting_port:
        cmd += ["--starting-port", str(starting_port)]
    return [*cmd, "--", sys.executable, "-m", "tierchat.cli.main", *argv]


def relaunch(
    argv: Sequence[str],
    hostfile: str,
    backend: str | None = None,
    starting_port: int | None = None,
) -> int:
    """Replace this process with ``mlx.launch`` running ``tierchat ARGV`` on every rank
    (:func:`launch_argv`).

    Raises:
        CLIError: mlx.launch is missing or cannot be started, or no such hostfile.
    """
    cmd = launch_argv(argv, hostfile, backend, starting_port)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(cmd[0], cmd)
    except OSError as e:
        raise CLIError(f"cannot start {cmd[0]}: {e.strerror or e}") from None
    return EXIT_FAILED  # pragma: no cover - execv does not return


_WORKERS: list[Any] = []  # worker ranks this process started itself (the TUI's ring)


def run_rank(
    args: Any, settings: Any, dispatch: Callable[[Any, Any], int], timeout_s: float | None
) -> int:
    """A launched process: join the ranks; rank 0 runs ``dispatch(args, settings)``,
    the others :func:`run_worker`. Rank 0 ends the process itself, without the
    interpreter's teardown, once its command is done; when the ranks failed (a rank lost
    or silent past the timeout), with code 1 after its error line: its engine thread may
    still be blocked in a collective."""
    from tierchat.core.engine import distributed as dist

    try:
        ranks = dist.current(timeout_s)
    except dist.RankError as e:
        raise CLIError(str(e)) from None
    if ranks is None:  # a group of one: nothing to share
        return dispatch(args, settings)
    settings = rank_settings(settings, ranks.rank, ranks.size)
    if not ranks.is_main:
        return run_worker(settings)
    tui = args.command is None or getattr(args, "console", False)
    if tui and not sys.stdout.isatty():
        raise CLIError(
            "the TUI needs a terminal, which mlx.launch does not give rank 0: run "
            "`tierchat --hostfile HOSTS` in a terminal (ring backend), or use `chat`, "
            "`serve` or `replay` under mlx.launch",
            EXIT_USAGE,
        )
    try:
        code = dispatch(args, settings)
    finally:
        if not ranks.failed:
            # every engine is closed: the workers end cleanly, not on a broken socket
            ranks.send_exit()
    if ranks.failed:
        print(f"error: {ranks.failed}", file=sys.stderr, flush=True)
        code = code or EXIT_FAILED
    elif _WORKERS:
        return code  # the TUI's own ring: its exit handler waits for the workers it started
    # every engine is closed and the workers were told to exit: skip the interpreter's
    # teardown, which would destroy the group's communicator after the workers left
    # (NCCL on two H200s: "NCCL error ... unhandled cuda error" and exit code 1 at the
    # end of a successful replay) or with a blocked engine thread
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_settings(settings: Any, rank: int, size: int) -> Any:
    """``settings`` with this rank's own cache dir, ``<cache_dir>/rank<R>-of-<N>``: each
    rank owns (locks) its dir, also where several ranks share one machine and one
    ``--cache-dir``, and a layout of another size is another dir."""
    import dataclasses

    return dataclasses.replace(
        settings, cache_dir=Path(settings.cache_dir) / f"rank{rank}-of-{size}"
    )


def run_worker(settings: Any) -> int:
    """A rank > 0: an engine with no UI, running rank 0's messages until rank 0 ends.
    Exit code 0 when rank 0 ended cleanly, 1 when it was lost or this rank failed."""
    from tierchat.core.engine.engine import Engine
    from tierchat.core.engine.worker import serve_worker

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    engine = Engine(settings, on_log=log)
    clean = False
    try:
        clean = engine.call(lambda: serve_worker(engine, log))
    finally:
        engine.close()
        # skip the interpreter's teardown: the group's sockets may be broken (rank 0
        # lost), and MLX's ring threads abort when torn down then
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_OK if clean else EXIT_FAILED)


def start_workers(
    argv: Sequence[str],
    hostfile: str,
    backend: str | None = None,
    starting_port: int | None = None,
) -> list[Any]:
    """Make this process rank 0 of a ring and start ranks 1.. on the other hosts of
    ``hostfile``, as ``mlx.launch --backend ring`` does (its ``RemoteProcess``: ssh, or a
    local shell for 127.0.0.1), so that rank 0 keeps this terminal (the TUI needs one).
    The first host must be this machine. The workers' output goes to a log file named on
    stderr. Returns the processes; :func:`stop_workers` ends them.

    Raises:
        CLIError: not the ring backend, a host without IPs, or a bad hostfile.
    """
    import atexit
    import json
    import tempfile
    import threading

    from mlx._distributed_utils.common import Hostfile
    from mlx._distributed_utils.launch import RemoteProcess

    try:
        hosts = Hostfile.from_file(hostfile)
    except ValueError as e:
        raise CLIError(f"{hostfile}: {e}", EXIT_USAGE) from None
    if (backend or hosts.backend or "ring") != "ring":
        raise CLIError(
            "the TUI across ranks runs on the ring backend only (rank 0 keeps the "
            "terminal); use `chat`, `serve` or `replay` with other backends",
            EXIT_USAGE,
        )
    port, ring = starting_port or 32323, []
    for h in hosts.hosts:
        if not h.ips:
            raise CLIError(f"{hostfile}: host {h.ssh_hostname} has no ips (the ring needs them)")
        ring.append([f"{ip}:{port + k}" for k, ip in enumerate(h.ips)])
        port += len(h.ips)
    ring_json = json.dumps(ring)
    tmp = Path(tempfile.mkdtemp(prefix="tierchat-ranks-"))
    (tmp / "ring.json").write_text(ring_json)
    os.environ["MLX_HOSTFILE"] = str(tmp / "ring.json")
    os.environ["MLX_RANK"] = "0"
    cmd = [sys.executable, "-m", "tierchat.cli.main", *argv]
    procs = []
    for rank, h in enumerate(hosts.hosts):
        if rank == 0:
            continue
        p = RemoteProcess(
            rank, h.ssh_hostname, None, None, {"MLX_HOSTFILE": ring_json}, list(hosts.envs), cmd
        )
        log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115 -- the drain threads own it
        for stream, is_stdout in ((p.process.stdout, True), (p.process.stderr, False)):
            threading.Thread(target=_drain, args=(p, stream, is_stdout, log), daemon=True).start()
        procs.append(p)
    print(f"tierchat: {len(procs)} worker rank(s) started; their log: {tmp}", file=sys.stderr)
    atexit.register(stop_workers, procs)
    _WORKERS.extend(procs)
    return procs


def _drain(proc: Any, stream: Any, is_stdout: bool, log: Any) -> None:
    for raw in iter(lambda: stream.read1(8192), b""):
        text = raw.decode(errors="replace")
        if is_stdout:
            text = proc.preprocess_output(text, True)  # its first line: the pid file
        log.write(text)
        log.flush()


def stop_workers(procs: list[Any], grace_s: float = 10.0) -> None:
    """Wait up to ``grace_s`` for the workers to end (rank 0 told them to), then end
    them (``RemoteProcess.terminate``: the remote pid too)."""
    import time

    deadline = time.monotonic() + grace_s
    for p in procs:
        while p.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if p.process.poll() is None:
            try:
                p.terminate()
            except Exception:  # noqa: BLE001 -- best effort at exit
                p.process.kill()
