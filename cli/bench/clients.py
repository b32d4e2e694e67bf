"""``tierchat bench --serve --clients N,N,...``: N concurrent streaming clients against
``tierchat serve`` and against ``mlx_lm.server``, one system after the other, on the same
model directory (docs/DESIGN.md §17: ratios measured together, never asserted).

Each client of a round of N: the round's system prompt (``system_tokens`` tokens of
deterministic text, a new first word per round, so no round reuses another's), then two
user turns of its own (client ``c``, turn ``t``: ``turn_tokens + 3 * (2c + t)`` tokens, so
no two requests of a round have the same length), each streamed, greedy, ``max_tokens``
per reply; the second turn sends back the client's OWN first reply as text, as a client
shows it. All N clients start together (one event); a round ends when the last reply ends.

Per round and system: aggregate tokens/s (every completion token of the round / seconds
from the start to the last reply's end), and TTFT (request sent to the first streamed
content, as the client sees it) median, p90 (nearest rank) and worst over the round's 2N
requests. The ratio columns: tierchat's tokens/s over mlx-lm's (> 1: tierchat answers more)
and tierchat's TTFT p90 over mlx-lm's (< 1: tierchat's first tokens come sooner).

Each server starts once, as a process of its own (tierchat: ``tierchat serve`` on a fresh
temporary cache dir with the bench's settings, :class:`~tierchat.cli.bench.serve.ServeProcess`;
mlx-lm as shipped: ``python -m mlx_lm server`` with its defaults, so its batched path), is
warmed with one short unrelated request and an unreported round of the most clients, then
runs the rounds in order. The clients are threads of this process, sharing an interpreter
with neither server (before, tierchat's ran in this process, its engine thread contending
with sixteen client threads for the GIL).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierchat.cli.bench.main import WARMUP_SALT, make_prompt
from tierchat.cli.bench.ranked import Ranks, describe_tier_use
from tierchat.cli.bench.serve import FILLER, TOPICS, MlxLm, ServeProcess, chat, kernel_env
from tierchat.cli.bench.workload_report import p90, ratio_text
from tierchat.cli.common import EXIT_OK, EXIT_USAGE, CLIError, table

TIERCHAT, MLX_LM = "tierchat", "mlx-lm"
TURNS = 2  # user turns per client
WARMUP_TOKENS = 24  # the warm-up request's prompt, tokens of unrelated text
RETRIES = 2  # a request whose connection fails is sent again, as OpenAI's client does


def parse_counts(text: str) -> list[int]:
    """``"1,4,8,16"`` -> ``[1, 4, 8, 16]``. Raises :class:`CLIError` (exit 2) for anything
    but positive integers, or more than 64 clients."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(not 1 <= n <= 64 for n in counts):
        raise CLIError(
            f"--clients {text!r}: expected integers from 1 to 64 separated by commas", EXIT_USAGE
        )
    return counts


@dataclass(frozen=True)
class Script:
    """What the clients of one round say: the system prompt and, per client, its user
    messages (:data:`TURNS` of them)."""

    system: str
    users: tuple[tuple[str, ...], ...]


def scripts(tokenizer: Any, counts: Sequence[int], system_tokens: int, turn_tokens: int):
    """One :class:`Script` per round (rules in the module doc), cut with ``tokenizer``."""

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids).strip()

    def user(c: int, t: int) -> str:
        n = turn_tokens + 3 * (TURNS * c + t)
        words = f"Client {c}, question {t + 1}. {TOPICS[(c + t) % len(TOPICS)]}. "
        words += FILLER * (1 + n // 40)
        return text(list(tokenizer.encode(words, add_special_tokens=False))[:n])

    out = []
    for k, n in enumerate(counts):
        system = text(make_prompt(tokenizer, system_tokens, salt=k))
        users = tuple(tuple(user(c, t) for t in range(TURNS)) for c in range(n))
        out.append(Script(system, users))
    return out


@dataclass(frozen=True)
class ClientRequest:
    """One request of one client: times in seconds from the round's start."""

    client: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    sent_s: float
    ttft_s: float
    done_s: float
    retries: int = 0


@dataclass
class Round:
    """One round of ``clients`` concurrent clients on one server."""

    server: str
    clients: int
    wall_s: float = 0.0
    requests: list[ClientRequest] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(r.completion_tokens for r in self.requests)
        return tokens / self.wall_s if self.wall_s > 0 else 0.0

    def ttft(self) -> dict[str, float]:
        """``ttft_median_s``, ``ttft_p90_s``, ``ttft_worst_s`` over the round's requests."""
        got = [r.ttft_s for r in self.requests]
        return {
            "ttft_median_s": statistics.median(got),
            "ttft_p90_s": p90(got),
            "ttft_worst_s": max(got),
        }

    def summary(self) -> dict:
        return {
            "server": self.server,
            "clients": self.clients,
            "requests": len(self.requests),
            "completion_tokens": sum(r.completion_tokens for r in self.requests),
            "retries": sum(r.retries for r in self.requests),
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            **self.ttft(),
        }


def ask(port: int, messages: list[dict], max_tokens: int) -> tuple[str, dict, float, int]:
    """:func:`~tierchat.cli.bench.serve.chat`, sent again up to :data:`RETRIES` times when
    the connection fails (a full listen backlog under many clients resets some): (text,
    usage, TTFT from the first attempt, retries)."""
    t0 = time.perf_counter()
    for retry in range(RETRIES + 1):
        attempt = time.perf_counter() - t0
        try:
            text, usage, ttft = chat(port, messages, max_tokens)
        except ConnectionError:
            if retry == RETRIES:
                raise
            continue
        return text, usage, attempt + ttft, retry
    raise AssertionError("unreachable")


def run_round(server: str, port: int, script: Script, max_tokens: int) -> Round:
    """The clients of ``script`` against ``127.0.0.1:port``, all started together; each
    client's turns in order, its own replies sent back. Raises :class:`CLIError` when a
    request fails (after every client has stopped)."""
    n = len(script.users)
    out = Round(server, n)
    lock, go = threading.Lock(), threading.Event()
    errors: list[BaseException] = []
    t0 = 0.0

    def client(c: int) -> None:
        messages = [{"role": "system", "content": script.system}]
        go.wait()
        try:
            for t, text in enumerate(script.users[c]):
                messages.append({"role": "user", "content": text})
                sent = time.perf_counter() - t0
                reply, usage, ttft, retries = ask(port, messages, max_tokens)
                done = time.perf_counter() - t0
                messages.append({"role": "assistant", "content": reply})
                details = usage.get("prompt_tokens_details") or {}
                row = ClientRequest(
                    c,
                    t,
                    usage["prompt_tokens"],
                    details.get("cached_tokens") or 0,
                    usage.get("completion_tokens", 0),
                    round(sent, 6),
                    round(ttft, 6),
                    round(done, 6),
                    retries,
                )
                with lock:
                    out.requests.append(row)
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(n)]
    for th in threads:
        th.start()
    t0 = time.perf_counter()
    go.set()
    for th in threads:
        th.join()
    if errors:
        e = errors[0]
        raise e if isinstance(e, CLIError) else CLIError(f"{server} client failed: {e!r}")
    out.wall_s = max(r.done_s for r in out.requests)
    out.requests.sort(key=lambda r: (r.client, r.turn))
    return out


def run_server(
    server: str,
    start: Callable[[], Any],
    stop: Callable[[Any], None],
    port_of: Callable[[Any], int],
    warmup: str,
    rounds: Sequence[Script],
    max_tokens: int,
    log: Callable[[str], None],
    warm_round: Script | None = None,
) -> list[Round]:
    """Start one server, warm it with one request of ``warmup`` and the unreported round
    ``warm_round`` (None: none), run every round, stop."""
    handle = start()
    try:
        port = port_of(handle)
        chat(port, [{"role": "user", "content": warmup}], 8)
        if warm_round is not None:
            r = run_round(server, port, warm_round, max_tokens)
            log(f"{server}: warm-up round of {r.clients} clients, {r.tokens_per_s:.1f} tokens/s")
        got = []
        for script in rounds:
            r = run_round(server, port, script, max_tokens)
            s = r.ttft()
            retries = sum(q.retries for q in r.requests)
            log(
                f"{server}, {r.clients} client(s): {r.tokens_per_s:.1f} tokens/s, TTFT median "
                f"{s['ttft_median_s']:.2f} s, p90 {s['ttft_p90_s']:.2f} s"
                + (f" ({retries} requests sent again)" if retries else "")
            )
            got.append(r)
        return got
    finally:
        stop(handle)


@dataclass
class ClientsBench:
    """What :func:`clients_bench` measured: every round (tierchat's first) and the
    device line of tierchat's engine."""

    rounds: list[Round]
    device: str


def clients_bench(
    settings: Any,
    counts: Sequence[int],
    system_tokens: int = 1500,
    turn_tokens: int = 100,
    max_tokens: int = 64,
    baseline: bool = True,
    log: Callable[[str], None] = print,
    warm: bool = True,
    fresh_kernel_cache: bool = False,
    ranks: Ranks | None = None,
) -> ClientsBench:
    """Every round of :func:`run_round` on tierchat serve (a fresh temporary cache dir),
    then (with ``baseline``) on mlx_lm.server, same model directory. With ``warm`` each
    server first runs an unreported round of the most clients (its own system prompt):
    MLX builds GPU kernels per shape on first use and keeps them on disk
    (``MLX_PTX_CACHE_DIR``, by default under the temp dir), so without it the server that
    runs first pays the builds (~35 s per new batch shape of 4-bit weights on an H100)
    and the second finds them built. With ``fresh_kernel_cache`` each server gets an empty
    kernel cache of its own (:func:`~tierchat.cli.bench.serve.kernel_env`): with ``warm``
    off, its first round is the one users meet after an install or upgrade. ``ranks``:
    both servers on that many ranks of this host (:mod:`~tierchat.cli.bench.ranked`);
    ``settings.no_cache`` runs tierchat with its cache off (the same ranks' baseline)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tierchat.cli.bench.shape_export import mlx_model_dir
    from tierchat.core.device import describe_device
    from tierchat.core.models.loading import resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(settings.model, settings.models_dir))
    *rounds, warm_round = scripts(tok, [*counts, max(counts)], system_tokens, turn_tokens)
    if not warm:
        warm_round = None
    warmup = tok.decode(make_prompt(tok, WARMUP_TOKENS, salt=WARMUP_SALT)).strip()
    with tempfile.TemporaryDirectory(prefix="tierchat-clients-bench-") as tmp:
        fresh = {"cache_dir": Path(tmp) / "kv", "data_dir": Path(tmp) / "data"}

        def run(name: str, server: Any) -> list[Round]:
            env = kernel_env(Path(tmp) / f"kernels-{name}" if fresh_kernel_cache else None)
            if env:
                log(f"{name}: kernels in {env['MLX_PTX_CACHE_DIR']}")
            try:
                return run_server(
                    name,
                    lambda: server.start(extra_env=env),
                    server.stop,
                    server.port,
                    warmup,
                    rounds,
                    max_tokens,
                    log,
                    warm_round,
                )
            except CLIError as e:  # with the end of the server's own log
                raise CLIError(f"{e.message}\n{_tail(server.log_path)}") from None

        ours = ServeProcess(dataclasses.replace(settings, **fresh), Path(tmp), ranks)
        got = run(TIERCHAT, ours)
        if (line := describe_tier_use(fresh["cache_dir"])) is not None:
            log(f"{TIERCHAT}: {line}")
        if baseline:
            model_dir = mlx_model_dir(settings.model, settings.models_dir)
            log_path = Path(tmp) / "mlx_lm_server.log"
            got += run(MLX_LM, MlxLm(model_dir, max_tokens, log_path, ranks))
    return ClientsBench(got, describe_device())


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:] if path.exists() else ""


def summarize(rounds: Sequence[Round]) -> list[dict]:
    """One entry per client count: each system's :meth:`Round.summary` and the ratios
    ``tokens_ratio`` (tierchat / mlx-lm tokens/s) and ``ttft_p90_ratio`` (tierchat /
    mlx-lm TTFT p90); None without mlx-lm."""
    out = []
    for n in dict.fromkeys(r.clients for r in rounds):
        entry: dict[str, Any] = {"clients": n}
        for r in rounds:
            if r.clients == n:
                entry[r.server] = r.summary()
        ours, theirs = entry.get(TIERCHAT), entry.get(MLX_LM)
        both = ours is not None and theirs is not None
        entry["tokens_ratio"] = (
            ours["tokens_per_s"] / theirs["tokens_per_s"]
            if both and theirs["tokens_per_s"] > 0
            else None
        )
        entry["ttft_p90_ratio"] = (
            ours["ttft_p90_s"] / theirs["ttft_p90_s"] if both and theirs["ttft_p90_s"] > 0 else None
        )
        out.append(entry)
    return out


def format_summary(summary: Sequence[dict]) -> str:
    def cells(s: dict | None) -> tuple:
        if s is None:
            return ("-",) * 4
        times = (s["ttft_median_s"], s["ttft_p90_s"], s["ttft_worst_s"])
        return (f"{s['tokens_per_s']:.1f}", *(f"{t:.2f}" for t in times))

    rows = [
        (
            e["clients"],
            *cells(e.get(TIERCHAT)),
            *cells(e.get(MLX_LM)),
            ratio_text(e["tokens_ratio"]),
            ratio_text(e["ttft_p90_ratio"]),
        )
        for e in summary
    ]
    headers = ("clients", "tc tok/s", "tc TTFT med s", "tc p90 s", "tc worst s")
    headers += ("mlx tok/s", "mlx TTFT med s", "mlx p90 s", "mlx worst s")
    headers += ("tok/s tc/mlx", "p90 tc/mlx")
    return table(rows, headers)


def run_clients_bench(settings: Any, args: Any) -> int:
    """``tierchat bench --serve --clients N,N,...``: print the per-N table, write
    ``--json``."""
    counts = parse_counts(args.clients)
    if args.turn_tokens < 1 or args.system_tokens < 2:
        raise CLIError("--turn-tokens must be >= 1 and --system-tokens >= 2", EXIT_USAGE)
    if len(counts) >= WARMUP_SALT:  # + the warm-up round's system prompt
        raise CLIError(f"--clients: at most {WARMUP_SALT - 1} rounds", EXIT_USAGE)
    max_tokens = settings.sampling.max_tokens if hasattr(args, "max_tokens") else 64
    ranks = Ranks.from_args(args)

    def log(text: str) -> None:
        print(f"bench: {text}", file=sys.stderr, flush=True)

    got = clients_bench(
        settings,
        counts,
        args.system_tokens,
        args.turn_tokens,
        max_tokens,
        baseline=not args.no_baseline,
        log=log,
        warm=not getattr(args, "no_warm_round", False),
        fresh_kernel_cache=getattr(args, "fresh_kernel_cache", False),
        ranks=ranks,
    )
    summary = summarize(got.rounds)
    on = f" · {ranks.describe()}" if ranks.launched else ""
    on += " · tierchat with --no-cache" if settings.no_cache else ""
    print(
        f"model {settings.model} · {got.device}{on} · system prompt {args.system_tokens} tokens, "
        f"{TURNS} user turns per client from {args.turn_tokens} tokens, {max_tokens} tokens "
        "per reply, greedy, streaming"
    )
    print(format_summary(summary))
    print(
        "(tc = tierchat serve, mlx = mlx_lm.server defaults; tok/s = completion tokens of "
        "all clients / round seconds; TTFT over every request of the round)"
    )
    if args.json_out:
        doc = {
            "model": settings.model,
            "device": got.device,
            "system_tokens": args.system_tokens,
            "turn_tokens": args.turn_tokens,
            "turns": TURNS,
            "max_tokens": max_tokens,
            "clients": counts,
            "summary": summary,
            "rounds": [
                r.summary() | {"rows": [dataclasses.asdict(q) for q in r.requests]}
                for r in got.rounds
            ],
        }
        try:
            Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            raise CLIError(f"cannot write {args.json_out}: {e.strerror or e}") from None
    return EXIT_OK
