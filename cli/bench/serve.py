"""``tierchat bench --serve``: one multi-turn chat replayed through ``tierchat serve`` and
through ``mlx_lm.server`` (same model directory, both on 127.0.0.1), in one run.

The chat: a system prompt, ``turns`` user messages of ``turn_tokens`` tokens each (a
deterministic text), each followed by the server's own reply (greedy, ``max_tokens``).
Then both servers restart and the client goes on with a short follow-up over the whole
conversation; then it sends that last request again ("regenerate"). Each server sees only
its own replies, as a real client would show them.

Per request it records prompt tokens, cached tokens (``usage.prompt_tokens_details
.cached_tokens``, which both servers report), prefilled = prompt − cached, and TTFT as the
client sees it (request sent to the first streamed content). tierchat restarts as a new
engine on the same cache directory (a fresh temporary one per run: the first turn is
cold), so the SSD tier survives; mlx-lm's prompt cache lives in its process.

The servers run one after the other, never together (2-core machines); ours in this
process on a thread, mlx-lm as a subprocess (``python -m mlx_lm server``), with the system
OpenBLAS preloaded for it as for us (``LD_PRELOAD``). mlx-lm computes in the model
directory's dtype, tierchat in float32 on a CPU (docs/DESIGN.md §3): the same for ``demo``, whose
converted directory is float32; the prefilled-token columns do not depend on it.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tierchat.cli.bench.ranked import Ranks, exit_trouble, rank_pid, stop_ranks
from tierchat.cli.common import EXIT_OK, CLIError, start_engine, table

SYSTEM = "You are a concise assistant. Answer in two or three sentences."
FOLLOW_UP = "Thanks. Now summarize everything above in one sentence."
TOPICS = (
    "Explain how a prefix cache speeds up a chat with a language model",
    "Describe what happens to the cache when the server restarts",
    "Compare keeping key-value blocks in RAM with keeping them on an SSD",
    "Say why recurrent models need checkpoints instead of slices",
    "Give advice for keeping time to first token low on long conversations",
    "Explain what a sliding-window attention layer keeps and what it forgets",
)
FILLER = (
    "Please be specific and mention the trade-offs. Consider a user who chats for an hour "
    "with many long messages, edits earlier turns, regenerates replies and comes back the "
    "next day after closing the program. Think about memory limits, disk space, and what "
    "must stay exact so that the output is identical to a run without any cache at all. "
)


@dataclass(frozen=True)
class Turn:
    """One request of the replay and what one server said about it."""

    server: str  # "tierchat" | "mlx-lm"
    label: str  # "turn 1".., "restart", "regenerate"
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    completion_tokens: int
    cached_by: dict[str, int] = field(default_factory=dict)

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def user_messages(encode: Callable[[str], list[int]], decode, turns: int, n: int) -> list[str]:
    """``turns`` user messages of about ``n`` tokens each (cut with the model's tokenizer)."""
    out = []
    for i in range(turns):
        text = f"{TOPICS[i % len(TOPICS)]}. " + FILLER * (1 + n // 40)
        out.append(decode(encode(text)[:n]).strip())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(port: int, messages: list[dict], max_tokens: int, timeout_s: float = 1800) -> tuple:
    """One streamed chat request to ``127.0.0.1:port``; returns (text, usage, ttft_s)."""
    body = {
        "model": "default_model",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t0 = time.perf_counter()
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(body),
        {"Content-Type": "application/json", "Authorization": "Bearer bench"},
    )
    response = conn.getresponse()
    if response.status != 200:
        raise CLIError(f"server on port {port}: HTTP {response.status}: {response.read()[:300]!r}")
    text, usage, ttft = [], None, None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if "error" in chunk:
            raise CLIError(f"server on port {port}: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            delta = (choice.get("delta") or {}).get("content") or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(delta)
        usage = chunk.get("usage") or usage
    conn.close()
    if usage is None:
        raise CLIError(f"server on port {port} sent no usage")
    return "".join(text), usage, ttft if ttft is not None else time.perf_counter() - t0


def replay(
    server: str,
    start: Callable[[], Any],
    stop: Callable[[Any], None],
    port_of,
    users: list[str],
    max_tokens: int,
    log: Callable[[str], None],
) -> list[Turn]:
    """The chat through one server: turns, restart + follow-up, regenerate."""
    rows: list[Turn] = []
    messages = [{"role": "system", "content": SYSTEM}]

    def ask(label: str, handle) -> str:
        text, usage, ttft = chat(port_of(handle), messages, max_tokens)
        details = usage.get("prompt_tokens_details") or {}
        extra = usage.get("tierchat") or {}
        row = Turn(
            server,
            label,
            usage["prompt_tokens"],
            details.get("cached_tokens") or 0,
            ttft,
            usage.get("completion_tokens", 0),
            extra.get("cached_by", {}),
        )
        rows.append(row)
        log(
            f"{server} {label}: prompt {row.prompt_tokens}, prefilled {row.prefilled}, "
            f"TTFT {row.ttft_s:.2f}s"
        )
        return text

    handle = start()
    try:
        for i, text in enumerate(users):
            messages.append({"role": "user", "content": text})
            messages.append({"role": "assistant", "content": ask(f"turn {i + 1}", handle)})
    finally:
        stop(handle)
    handle = start()
    try:
        messages.append({"role": "user", "content": FOLLOW_UP})
        ask("restart", handle)
        ask("regenerate", handle)
    finally:
        stop(handle)
    return rows


# ---------------------------------------------------------------- the two servers


class Ours:
    """tierchat serve in this process: a new engine (same cache dir) per start."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def start(self):
        from tierchat.core.sampling_params import SamplingParams
        from tierchat.core.serve.app import create_app
        from tierchat.core.serve.log import RequestLog, TrackedEngine
        from tierchat.core.serve.server import ServerThread
        from tierchat.core.serve.state import ServeState, reply_memory_path

        engine = start_engine(self.settings, quiet=True)
        tracked = TrackedEngine(engine, RequestLog())
        state = ServeState(
            tracked,
            sampling=SamplingParams(seed=self.settings.sampling.seed),
            memory_path=reply_memory_path(self.settings, engine.model_name),
        )
        server = ServerThread(create_app(state)).start()
        return engine, server

    @staticmethod
    def stop(handle) -> None:
        engine, server = handle
        server.stop()
        engine.close()

    @staticmethod
    def port(handle) -> int:
        return handle[1].port


RANKED_STOP_S = 180.0
"""The least time a server on several ranks gets to stop by itself (each rank flushes its
own SSD tier, then rank 0 tells the workers to end) before its group is signalled."""


class Spawned(NamedTuple):
    """A server process :func:`spawn_server` started (``proc`` is mlx.launch when
    ``ranks`` has several)."""

    proc: subprocess.Popen
    port: int
    out: Any  # its log file, open for appending
    ranks: Ranks
    log_offset: int = 0  # the log's size when it started

    @property
    def main_pid(self) -> int:
        """The server's own process: rank 0's under mlx.launch (the launcher's while rank
        0 cannot be found)."""
        if self.ranks.launched:
            return rank_pid(self.proc.pid) or self.proc.pid
        return self.proc.pid


def spawn_server(
    name: str,
    cmd: list[str],
    port: int,
    log_path: Path,
    ready: Callable[[dict], bool],
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
    ranks: Ranks | None = None,
):
    """Start the server ``cmd`` (on 127.0.0.1:``port``, output appended to ``log_path``)
    with the system OpenBLAS preloaded on Linux, as for us, on ``ranks`` (None: one
    process; else under mlx.launch, :mod:`.ranked`); return its :class:`Spawned` once
    ``GET /health`` or ``/v1/models`` answers 200 with a body ``ready`` accepts.

    Raises:
        CLIError: it exits or is not ready in ``timeout_s``.
    """
    from tierchat.core import OPENBLAS_PATHS

    ranks = ranks or Ranks()

    env = dict(os.environ if env is None else env)
    blas = [p for p in OPENBLAS_PATHS if os.path.exists(p)]
    if blas and sys.platform == "linux":
        env["LD_PRELOAD"] = ":".join(filter(None, [blas[0], env.get("LD_PRELOAD")]))
    out = open(log_path, "ab")  # noqa: SIM115 -- closed in stop_server()
    offset = out.tell()
    proc = subprocess.Popen(
        ranks.wrap(cmd),
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=ranks.launched,  # stop_server signals the ranks' group
    )
    spawned = Spawned(proc, port, out, ranks, offset)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise CLIError(f"{name} exited ({proc.returncode}); see {log_path}")
            for path in ("/health", "/v1/models"):
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                    conn.request("GET", path)
                    got = conn.getresponse()
                    if got.status == 200 and ready(json.loads(got.read() or b"{}")):
                        return spawned
                except (OSError, ValueError):
                    pass
            time.sleep(0.5)
        raise CLIError(f"{name} did not start in {timeout_s:.0f}s; see {log_path}")
    except BaseException:  # Ctrl-C too: ranks in a session of their own would stay
        stop_server(spawned)
        raise


def stop_server(handle, timeout_s: float = 60) -> None:
    """SIGTERM (tierchat serve flushes its SSD tier on it), then SIGKILL after
    ``timeout_s``; a server on several ranks as :func:`~.ranked.stop_ranks` stops it, and
    what its ranks said of a failure since it started (:func:`~.ranked.exit_trouble`) is
    printed."""
    proc, _, out, ranks, _ = handle
    if ranks.launched:
        t0 = time.monotonic()
        # every rank writes its own SSD queue at the stop, then rank 0 ends the workers
        stop_ranks(proc, max(timeout_s, RANKED_STOP_S))
        said = exit_trouble(Path(out.name), handle.log_offset)
        if said:  # with the end of its output: what the ranks were doing
            print(
                f"bench: the server on {ranks.describe()} stopped in "
                f"{time.monotonic() - t0:.1f} s; a rank said:",
                *said,
                "its output's end:",
                _tail(Path(out.name), handle.log_offset, 3000),
                sep="\n  ",
                file=sys.stderr,
                flush=True,
            )
        out.close()
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    out.close()


def _tail(path: Path, offset: int, n: int) -> str:
    """The last ``n`` characters written to ``path`` after byte ``offset``."""
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, path.stat().st_size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def kernel_env(root: Path | None) -> dict[str, str]:
    """The variables that point MLX's kernel caches at a new dir under ``root`` (None:
    none): ``MLX_PTX_CACHE_DIR`` (CUDA) and ``TMPDIR`` (the CPU backend's compiled kernels)."""
    if root is None:
        return {}
    (root / "ptx").mkdir(parents=True, exist_ok=True)
    return {"MLX_PTX_CACHE_DIR": str(root / "ptx"), "TMPDIR": str(root)}


class MlxLm:
    """``python -m mlx_lm server`` on a free loopback port, for one model directory."""

    def __init__(
        self, model_dir: Path, max_tokens: int, log_path: Path, ranks: Ranks | None = None
    ) -> None:
        self.model_dir = model_dir
        self.max_tokens = max_tokens
        self.log_path = log_path
        self.ranks = ranks or Ranks()  # several: its own sharded_load under mlx.launch

    def start(self, timeout_s: float = 600, extra_env: dict[str, str] | None = None):
        """Start it; ``extra_env`` is added to its environment (a kernel cache dir)."""
        from tierchat.core.device import peer_env

        port = free_port()
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(self.model_dir)]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--max-tokens", str(self.max_tokens), "--log-level", "WARNING"]
        # as it ships: not the MLX variables an engine of this process set for itself
        env = peer_env() | (extra_env or {})
        return spawn_server(
            "mlx_lm.server", cmd, port, self.log_path, bool, env, timeout_s, self.ranks
        )

    stop = staticmethod(stop_server)

    @staticmethod
    def port(handle) -> int:
        return handle[1]


class ServeProcess:
    """``tierchat serve`` as a process of its own on a free loopback port, with exactly
    ``settings`` (written to a config file; ``TIERCHAT_*`` variables of this process are
    not passed on), as users run it and as ``mlx_lm.server`` runs beside it: the bench's
    client threads then share no interpreter (no GIL) with either server."""

    def __init__(self, settings: Any, workdir: Path, ranks: Ranks | None = None) -> None:
        from tierchat.config.settings import to_toml

        self.settings = settings
        self.ranks = ranks or Ranks()  # several: a cache dir per rank under cache_dir
        self.config = workdir / "serve.toml"
        self.config.write_text(to_toml(settings))
        self.log_path = workdir / "tierchat_serve.log"

    def start(self, timeout_s: float = 900, extra_env: dict[str, str] | None = None):
        """Start it; ``extra_env`` is added to its environment (a kernel cache dir)."""
        port = free_port()
        cmd = [sys.executable, "-m", "tierchat.cli.main", "serve"]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCHAT_")}
        env["TIERCHAT_CONFIG"] = str(self.config)
        env |= extra_env or {}
        loaded = lambda body: body.get("status") == "ok"  # noqa: E731 -- the model loaded
        return spawn_server(
            "tierchat serve", cmd, port, self.log_path, loaded, env, timeout_s, self.ranks
        )

    stop = staticmethod(stop_server)

    @staticmethod
    def port(handle) -> int:
        return handle[1]


# ---------------------------------------------------------------- the command


def serve_bench(
    settings: Any,
    turns: int = 4,
    turn_tokens: int = 200,
    max_tokens: int = 32,
    baseline: bool = True,
    log: Callable[[str], None] = print,
) -> list[Turn]:
    """Replay the chat through tierchat (a fresh temporary cache dir) and mlx-lm; returns
    every request's :class:`Turn`, tierchat's first."""
    from tierchat.cli.bench.shape_export import mlx_model_dir

    with tempfile.TemporaryDirectory(prefix="tierchat-serve-bench-") as tmp:
        fresh = {"cache_dir": Path(tmp) / "kv", "data_dir": Path(tmp) / "data", "no_cache": False}
        ours = Ours(dataclasses.replace(settings, **fresh))
        engine = start_engine(ours.settings, quiet=True)
        try:
            tok = engine.tokenizer
            users = user_messages(
                lambda t: tok.encode(t, add_special_tokens=False), tok.decode, turns, turn_tokens
            )
        finally:
            engine.close()
        rows = replay("tierchat", ours.start, ours.stop, ours.port, users, max_tokens, log)
        if baseline:
            model_dir = mlx_model_dir(settings.model, settings.models_dir)
            mlx = MlxLm(model_dir, max_tokens, Path(tmp) / "mlx_lm_server.log")
            try:
                rows += replay("mlx-lm", mlx.start, mlx.stop, mlx.port, users, max_tokens, log)
            except CLIError as e:
                log_file = Path(tmp) / "mlx_lm_server.log"
                tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
                raise CLIError(f"{e.message}\n{tail}") from None
    return rows


def report(rows: list[Turn]) -> str:
    ours = [r for r in rows if r.server == "tierchat"]
    theirs = {r.label: r for r in rows if r.server == "mlx-lm"}
    lines = []
    for r in ours:
        t = theirs.get(r.label)
        ratio = "-"
        if t is not None:
            ratio = f"{t.prefilled / r.prefilled:.1f}x" if r.prefilled else "inf"
        by = " ".join(f"{k} {v}" for k, v in r.cached_by.items() if v) or "-"
        lines.append(
            (
                r.label,
                r.prompt_tokens,
                r.prefilled,
                f"{r.ttft_s:.2f}",
                by,
                t.prompt_tokens if t else "-",
                t.prefilled if t else "-",
                f"{t.ttft_s:.2f}" if t else "-",
                ratio,
            )
        )
    headers = (
        "request",
        "prompt",
        "prefilled",
        "TTFT s",
        "cached by tier",
        "mlx-lm prompt",
        "mlx-lm prefilled",
        "mlx-lm TTFT s",
        "prefilled ratio",
    )
    return table(lines, headers)


def run_serve_bench(settings: Any, args: Any) -> int:
    """``tierchat bench --serve``: print the per-request table (and ``--json-out``)."""
    if args.turns < 1 or args.turn_tokens < 1:
        raise CLIError("--turns and --turn-tokens must be at least 1", 2)
    max_tokens = settings.sampling.max_tokens if hasattr(args, "max_tokens") else 32

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    rows = serve_bench(
        settings, args.turns, args.turn_tokens, max_tokens, baseline=not args.no_baseline, log=log
    )
    print(
        f"model {settings.model} · block {settings.block_size} tokens · "
        f"{args.turns} turns of {args.turn_tokens} tokens · max_tokens {max_tokens}"
    )
    print(report(rows))
    if args.json_out:
        doc = {
            "model": settings.model,
            "block_size": settings.block_size,
            "rows": [dataclasses.asdict(r) | {"prefilled": r.prefilled} for r in rows],
        }
        try:
            Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            raise CLIError(f"cannot write {args.json_out}: {e.strerror or e}") from None
    return EXIT_OK
