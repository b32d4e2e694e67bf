"""``tierchat bench --agent SESSION...``: recorded agent-CLI sessions (cli/workloads/
agent-*.jsonl[.gz], :mod:`tierchat.cli.bench.agent_sessions`) replayed over HTTP through
``tierchat serve`` and ``mlx_lm.server``, one server after the other, on the same model
directory (docs/DESIGN.md §17: ratios measured together, never asserted).

Each server: started as a process of its own (:class:`~tierchat.cli.bench.serve.
ServeProcess` on a fresh temporary cache dir with the bench's settings; ``python -m mlx_lm
server`` as shipped), then every conversation at once: each SESSION times ``--sessions N``
copies, copy ``k`` with `` (sub-agent k)`` after its first user message when N > 1 (so the
copies share the system prompt and tools, as sub-agents do). A conversation sends its
recorded requests in order, each streamed, greedy, at most ``--max-tokens``: tierchat gets
the body as recorded (Anthropic Messages, Responses or chat), mlx_lm.server the same
conversation as chat completions with tools (:func:`~tierchat.cli.bench.agent_sessions.
as_chat_body`). The later requests carry the recorded replies, not the server's, so both
servers see the same prompts. With ``--restart-after K`` every conversation stops after its
K-th request, the server gets SIGTERM (tierchat writes its SSD tier), starts again (same
cache dir, same kernel cache) and the conversations go on. Then, with the server still up,
cold requests of unrelated text at a few lengths up to the longest prompt measure its
prefill curve for the floors (:mod:`tierchat.cli.bench.agent_report`).

Per request: TTFT (request sent to the first streamed event of the reply, as the client
sees it), prompt / cached tokens as the server reports them (mlx_lm.server reports
``prompt_tokens_details.cached_tokens`` too), new tokens (the model's chat template over the
chat form; :func:`~tierchat.cli.bench.agent_report.new_tokens`), the floor and the cold
estimate. tierchat's SSD bytes: ``/health`` ``ssd_writes.total_bytes`` (kept across
restarts, so the shutdown flush counts) after each request. Memory per server: the peak
resident set (``VmHWM`` of ``/proc/<pid>/status``, every process of the run), the GPU memory
``nvidia-smi`` reports for the process (sampled every 0.5 s; None without it, or when the
server's pid is not visible to it) and tierchat's MLX peak (``/health`` ``memory.peak_bytes``,
sampled; mlx_lm.server exposes none).

Kernel caches (``--fresh-kernel-cache``): each server runs with ``MLX_PTX_CACHE_DIR`` (the
CUDA backend's on-disk cache of compiled kernels, default ``$TMPDIR/mlx/<version>/ptx``)
and ``TMPDIR`` (the CPU backend writes its compiled kernels to ``$TMPDIR/mlx/<version>/
cpu``) pointed at a new empty directory of its own, so neither finds the other's builds.
Metal has no MLX kernel cache on disk (kernels come with the library or are built in the
process).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tierchat.cli.bench.agent_report import (
    MLX_LM,
    TIERCHAT,
    AgentRequest,
    ServerRun,
    fit_prefill_curve,
    new_tokens,
    ratios,
    request_table,
    summary_table,
    to_json,
)
from tierchat.cli.bench.agent_sessions import (
    RecordedRequest,
    as_chat_body,
    load_session,
    replay_body,
    session_path,
    with_suffix,
)
from tierchat.cli.bench.ranked import Ranks, describe_tier_use
from tierchat.cli.bench.serve import kernel_env
from tierchat.cli.common import EXIT_OK, EXIT_USAGE, CLIError
from tierchat.core.sampling_params import SamplingParams

CALIBRATION_SALT = 1  # the floor prompts' first words: CODEWORDS[1..]
SAMPLE_S = 0.5  # memory sampling period


@dataclass(frozen=True)
class Conversation:
    """One copy of one session: its requests (tagged) and their new-token counts."""

    session: str
    copy: int
    requests: tuple[RecordedRequest, ...]
    new: tuple[int, ...]
    prompt_lengths: tuple[int, ...]


@dataclass(frozen=True)
class Reply:
    """What a streamed reply told the client: tokens as the server counted them and the
    times from the send (s)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    done_s: float


# ---------------------------------------------------------------- one streamed request


def _first_output(api: str, event: dict) -> bool:
    """Whether ``event`` carries the first part of the reply (text, reasoning, a call)."""
    if api == "messages":
        return event.get("type") in ("content_block_start", "content_block_delta")
    if api == "responses":
        return str(event.get("type", "")).endswith(".delta") or (
            event.get("type") == "response.output_item.added"
        )
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
            return True
    return False


def read_usage(api: str, event: dict, seen: dict) -> None:
    """Fold ``event``'s usage into ``seen`` (``prompt``, ``cached``, ``completion``)."""
    if api == "messages":
        u = event.get("usage") or (event.get("message") or {}).get("usage")
        if u and event.get("type") == "message_delta":
            cached = u.get("cache_read_input_tokens") or 0
            seen |= {"prompt": (u.get("input_tokens") or 0) + cached, "cached": cached}
            seen["completion"] = u.get("output_tokens") or 0
        return
    if api == "responses":
        u = (event.get("response") or {}).get("usage")
        if u and event.get("type") == "response.completed":
            details = u.get("input_tokens_details") or {}
            seen |= {"prompt": u["input_tokens"], "cached": details.get("cached_tokens") or 0}
            seen["completion"] = u.get("output_tokens") or 0
        return
    u = event.get("usage")
    if u:
        details = u.get("prompt_tokens_details") or {}
        seen |= {"prompt": u["prompt_tokens"], "cached": details.get("cached_tokens") or 0}
        seen["completion"] = u.get("completion_tokens") or 0


def stream(port: int, api: str, path: str, body: dict, timeout_s: float = 3600) -> Reply:
    """POST ``body`` (made streaming) to ``127.0.0.1:port`` ``path`` and read the stream.
    Raises :class:`CLIError` on an HTTP error, an error event or a stream without usage."""
    body = {**body, "stream": True}
    if api == "chat":
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t0 = time.perf_counter()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
    conn.request("POST", path, json.dumps(body), headers)
    response = conn.getresponse()
    if response.status != 200:
        raise CLIError(f"port {port} {path}: HTTP {response.status}: {response.read()[:400]!r}")
    seen: dict[str, int] = {}
    ttft = None
    for raw in response:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if "error" in event or event.get("type") in ("error", "response.failed"):
            raise CLIError(f"port {port} {path}: {str(event)[:400]}")
        if ttft is None and _first_output(api, event):
            ttft = time.perf_counter() - t0
        read_usage(api, event, seen)
    done = time.perf_counter() - t0
    conn.close()
    if "prompt" not in seen:
        raise CLIError(f"port {port} {path}: the stream ended without usage")
    return Reply(seen["prompt"], seen["cached"], seen["completion"], ttft or done, done)


# ---------------------------------------------------------------- servers and their figures


def _get_json(port: int, path: str) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read() or b"{}")
    finally:
        conn.close()


def rss_peak_bytes(pid: int) -> int | None:
    """``VmHWM`` (peak resident set) of ``/proc/<pid>/status`` in bytes; None if absent."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_bytes(pid: int) -> int | None:
    """The GPU memory ``nvidia-smi`` reports for ``pid`` (bytes); None without nvidia-smi
    or when the process is not listed."""
    if shutil.which("nvidia-smi") is None:
        return None
    cmd = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1]) << 20
    return None


class MemorySampler:
    """Peaks of one server process, sampled every :data:`SAMPLE_S` on a thread until
    :meth:`stop`: resident set (``VmHWM``, exact), GPU memory (``nvidia-smi``), and with
    ``health`` tierchat's MLX peak from ``/health``."""

    def __init__(self, pid: int, port: int, health: bool) -> None:
        self.pid, self.port, self.health = pid, port, health
        self.rss: int | None = None
        self.gpu: int | None = None
        self.mlx: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _max(a: int | None, b: int | None) -> int | None:
        return b if a is None else a if b is None else max(a, b)

    def sample(self) -> None:
        self.rss = self._max(self.rss, rss_peak_bytes(self.pid))
        self.gpu = self._max(self.gpu, gpu_bytes(self.pid))
        if self.health:
            try:
                mem = _get_json(self.port, "/health").get("memory") or {}
                self.mlx = self._max(self.mlx, mem.get("peak_bytes"))
            except (OSError, ValueError):
                pass

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # the last reading, before the process goes


def ssd_total_bytes(port: int) -> int:
    """tierchat serve's ``/health`` ``ssd_writes.total_bytes`` (every session of the dir)."""
    return int((_get_json(port, "/health").get("ssd_writes") or {}).get("total_bytes") or 0)


# ---------------------------------------------------------------- the replay


def conversations(
    names: Sequence[str], copies: int, count_ids: Callable[[RecordedRequest], list[int]]
) -> list[Conversation]:
    """Every session times ``copies``, tagged apart when ``copies`` > 1, with the new
    tokens of each request (counted on the untagged session: the copies differ only in
    their first request, all new anyway)."""
    out = []
    for name in names:
        requests = load_session(name)
        if not requests:
            raise CLIError(f"session {name!r} has no requests", EXIT_USAGE)
        ids = [count_ids(r) for r in requests]
        new, lengths = tuple(new_tokens(ids)), tuple(len(x) for x in ids)
        label = Path(name).name.removeprefix("agent-").split(".")[0]
        for k in range(copies):
            tag = f" (sub-agent {k + 1})" if copies > 1 else ""
            tagged = tuple(with_suffix(r, tag) for r in requests)
            out.append(Conversation(label, k, tagged, new, lengths))
    return out


def chat_form(request: RecordedRequest, max_tokens: int) -> dict[str, Any]:
    """``request`` as the chat-completions body mlx_lm.server gets."""
    state = SimpleNamespace(sampling=SamplingParams(max_tokens=max_tokens, seed=0))
    return as_chat_body(request, state, max_tokens)


class Replayer:
    """One server's replay: start, conversations in phases with a restart between,
    calibration, stop; the figures in a :class:`ServerRun`."""

    def __init__(
        self,
        name: str,
        launcher: Any,
        convs: Sequence[Conversation],
        max_tokens: int,
        restart_after: int | None,
        kernels: Path | None,
        log: Callable[[str], None],
    ) -> None:
        self.name, self.launcher, self.convs = name, launcher, list(convs)
        self.max_tokens, self.restart_after, self.log = max_tokens, restart_after, log
        self.env = kernel_env(kernels)
        self.run = ServerRun(name)  # type: ignore[arg-type]
        self.lock = threading.Lock()
        self.ssd_seen = 0
        self.t0 = 0.0

    def _body(self, r: RecordedRequest) -> tuple[str, str, dict]:
        if self.name == TIERCHAT:
            return r.api, r.path, replay_body(r, self.max_tokens)
        return "chat", "/v1/chat/completions", chat_form(r, self.max_tokens)

    def _one(self, port: int, conv: Conversation, i: int, phase: str) -> None:
        api, path, body = self._body(conv.requests[i])
        sent = time.perf_counter() - self.t0
        reply = stream(port, api, path, body)
        ssd = None
        if self.name == TIERCHAT:
            with self.lock:
                total = ssd_total_bytes(port)
                ssd, self.ssd_seen = total - self.ssd_seen, total
        row = AgentRequest(
            self.name,  # type: ignore[arg-type]
            conv.session,
            conv.copy,
            i,
            phase,  # type: ignore[arg-type]
            conv.requests[i].api,
            reply.prompt_tokens,
            reply.cached_tokens,
            conv.new[i],
            reply.completion_tokens,
            round(sent, 6),
            round(reply.ttft_s, 6),
            round(reply.done_s, 6),
            ssd_bytes=ssd,
        )
        with self.lock:
            self.run.requests.append(row)
        self.log(
            f"{self.name} {conv.session}#{i} copy {conv.copy}: prompt {row.prompt_tokens}, "
            f"cached {row.cached_tokens}, new {row.new_tokens}, TTFT {row.ttft_s:.2f}s"
        )

    def _phase(self, port: int, lo: int, hi: int | None, phase: str) -> None:
        """Every conversation's requests ``lo:hi`` at once; adds the phase's wall time."""
        errors: list[BaseException] = []
        go = threading.Event()

        def client(conv: Conversation) -> None:
            go.wait()
            try:
                for i in range(lo, min(hi or len(conv.requests), len(conv.requests))):
                    self._one(port, conv, i, phase)
            except BaseException as e:  # noqa: BLE001 -- re-raised below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in self.convs]
        for th in threads:
            th.start()
        start = time.perf_counter()
        go.set()
        for th in threads:
            th.join()
        self.run.wall_s += time.perf_counter() - start
        if errors:
            e = errors[0]
            raise e if isinstance(e, CLIError) else CLIError(f"{self.name}: {e!r}")

    def _start(self):
        handle = self.launcher.start(extra_env=self.env)
        pid, port = handle.main_pid, handle.port
        return handle, port, MemorySampler(pid, port, health=self.name == TIERCHAT)

    def _stop(self, handle, sampler: MemorySampler) -> None:
        sampler.stop()
        self.run.peak_rss_bytes = MemorySampler._max(self.run.peak_rss_bytes, sampler.rss)
        self.run.peak_gpu_bytes = MemorySampler._max(self.run.peak_gpu_bytes, sampler.gpu)
        self.run.peak_mlx_bytes = MemorySampler._max(self.run.peak_mlx_bytes, sampler.mlx)
        self.launcher.stop(handle)

    def check_context(self, port: int) -> None:
        """Raise :class:`CLIError` when the longest prompt and its reply do not fit the
        context ``/v1/models`` reports (tierchat serve would refuse those requests with a
        400; mlx_lm.server reports none)."""
        models = _get_json(port, "/v1/models").get("data") or [{}]
        context = models[0].get("context_length")
        longest = max(max(c.prompt_lengths) for c in self.convs)
        if isinstance(context, int) and longest + self.max_tokens > context:
            raise CLIError(
                f"the session's longest prompt is {longest:,} tokens but the model's context "
                f"is {context:,}: pick a model with a longer one (shape:qwen3-8b-128k)",
                EXIT_USAGE,
            )

    def replay(self, calibrate: Callable[[int], list[tuple[int, float]]] | None) -> ServerRun:
        """The whole run; ``calibrate(port)`` returns the cold ``(tokens, TTFT)`` points
        (None: no floors)."""
        handle, port, sampler = self._start()
        try:
            self.check_context(port)
            self.t0 = time.perf_counter()
            k = self.restart_after
            self._phase(port, 0, k, "before")
            if k is not None:
                self._stop(handle, sampler)
                handle = None
                self.log(f"{self.name}: restart (SIGTERM, then start) after request {k}")
                handle, port, sampler = self._start()
                self.run.restarts += 1
                self._phase(port, k, None, "after")
            if self.name == TIERCHAT:
                self.run.ssd_bytes = ssd_total_bytes(port)
            if calibrate is not None:
                self.run.calibration = calibrate(port)
        finally:
            if handle is not None:
                self._stop(handle, sampler)
        if self.run.calibration:
            curve = fit_prefill_curve(self.run.calibration)
            self.run.curve = curve
            self.run.requests = [
                dataclasses.replace(
                    r,
                    floor_s=curve.floor_s(r.prompt_tokens, r.new_tokens),
                    cold_s=curve.cold_s(r.prompt_tokens),
                )
                for r in self.run.requests
            ]
        self.run.requests.sort(key=lambda r: (r.session, r.index, r.copy))
        return self.run


SHORTEST_CALIBRATION = 256  # tokens: the floor's shortest cold prompt


def calibration_lengths(longest: int, points: int) -> list[int]:
    """``points`` prompt lengths for the floor, spaced evenly in ``log n`` from
    :data:`SHORTEST_CALIBRATION` tokens (or ``longest``, if shorter) to ``longest``: the
    short ones pin the fixed and per-token costs (the floor of a turn with few new tokens),
    the long ones attention's quadratic term. Lengths closer than 64 tokens merge."""
    lo = min(SHORTEST_CALIBRATION, longest)
    if points <= 1 or lo == longest:
        return [longest]
    out: list[int] = []
    for j in range(points):
        n = round(lo * (longest / lo) ** (j / (points - 1)))
        if not out or n - out[-1] >= 64:
            out.append(n)
    out[-1] = longest
    return out


def make_calibrate(tokenizer: Any, lengths: Sequence[int], log) -> Callable[[int], list]:
    """The calibration: one cold chat request per length (unrelated text, a new first word
    each), 1 token generated; returns ``(prompt tokens, TTFT s)`` per request."""
    from tierchat.cli.bench.main import make_prompt

    texts = [
        tokenizer.decode(make_prompt(tokenizer, n, salt=CALIBRATION_SALT + j)).strip()
        for j, n in enumerate(lengths)
    ]

    def calibrate(port: int) -> list[tuple[int, float]]:
        points = []
        for text in texts:
            body = {
                "model": "default_model",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 1,
                "temperature": 0,
            }
            reply = stream(port, "chat", "/v1/chat/completions", body)
            points.append((reply.prompt_tokens, round(reply.ttft_s, 6)))
            log(f"  floor point: {reply.prompt_tokens} tokens cold, {reply.ttft_s:.2f}s")
        return points

    return calibrate


def chat_ids(tokenizer: Any, max_tokens: int) -> Callable[[RecordedRequest], list[int]]:
    """The prompt ids mlx_lm.server builds for a request (its ``process_message_content``
    and the tokenizer's chat template with the tools)."""
    import copy

    from mlx_lm.server import process_message_content

    def count(r: RecordedRequest) -> list[int]:
        body = chat_form(r, max_tokens)
        messages = copy.deepcopy(body["messages"])
        process_message_content(messages)
        kwargs = body.get("chat_template_kwargs") or {}
        ids = tokenizer.apply_chat_template(
            messages, tools=body.get("tools"), add_generation_prompt=True, tokenize=True, **kwargs
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    return count


def agent_bench(
    settings: Any,
    sessions: Sequence[str],
    copies: int = 1,
    restart_after: int | None = None,
    max_tokens: int = 16,
    baseline: bool = True,
    floor_points: int = 4,
    fresh_kernel_cache: bool = False,
    log: Callable[[str], None] = print,
    ranks: Ranks | None = None,
) -> list[ServerRun]:
    """Replay ``sessions`` through tierchat serve, then (``baseline``) mlx_lm.server;
    returns one :class:`ServerRun` per server. ``floor_points`` 0: no floors. ``ranks``:
    both servers on that many ranks of this host (:mod:`~tierchat.cli.bench.ranked`;
    memory figures are rank 0's)."""
    from mlx_lm.utils import load_tokenizer
    from tierchat.cli.bench.serve import MlxLm, ServeProcess
    from tierchat.cli.bench.shape_export import mlx_model_dir

    model_dir = mlx_model_dir(settings.model, settings.models_dir)
    tokenizer = load_tokenizer(Path(model_dir))
    convs = conversations(sessions, copies, chat_ids(tokenizer, max_tokens))
    longest = max(len(c.requests) for c in convs)
    if restart_after is not None and not 1 <= restart_after < longest:
        raise CLIError(f"--restart-after {restart_after}: expected 1 to {longest - 1}", EXIT_USAGE)
    calibrate = None
    if floor_points > 0:
        most = max(max(c.prompt_lengths) for c in convs)
        calibrate = make_calibrate(tokenizer, calibration_lengths(most, floor_points), log)
    runs = []
    with tempfile.TemporaryDirectory(prefix="tierchat-agent-bench-") as tmp:
        root = Path(tmp)
        fresh = {"cache_dir": root / "kv", "data_dir": root / "data", "no_cache": False}
        ours = ServeProcess(dataclasses.replace(settings, **fresh), root, ranks)
        launchers = [(TIERCHAT, ours)]
        if baseline:
            theirs = MlxLm(model_dir, max_tokens, root / "mlx_lm_server.log", ranks)
            launchers.append((MLX_LM, theirs))
        for name, launcher in launchers:
            kernels = root / f"kernels-{name}" if fresh_kernel_cache else None
            log(
                f"{name}: {len(convs)} conversations"
                + (f", kernels in {kernels}" if kernels else "")
            )
            replayer = Replayer(name, launcher, convs, max_tokens, restart_after, kernels, log)
            try:
                runs.append(replayer.replay(calibrate))
            except CLIError as e:
                log_file = getattr(launcher, "log_path", None)
                tail = ""
                if log_file is not None and Path(log_file).exists():
                    tail = Path(log_file).read_text(errors="replace")[-2000:]
                if name == TIERCHAT:
                    raise CLIError(f"{name}: {e.message}\n{tail}") from None
                # the peer failing (out of memory at a long prompt) is a result: its rows
                # so far are reported, the ratios over the requests both answered
                run = replayer.run
                run.failure = e.message.splitlines()[0][:300]
                run.requests.sort(key=lambda r: (r.session, r.index, r.copy))
                runs.append(run)
                log(f"{name}: failed after {len(run.requests)} requests: {e.message}\n{tail}")
            if name == TIERCHAT and (line := describe_tier_use(fresh["cache_dir"])):
                log(f"{TIERCHAT}: {line}")
    return runs


def run_agent_bench(settings: Any, args: Any) -> int:
    """``tierchat bench --agent``: the per-request and summary tables (and ``--json``)."""
    if args.sessions < 1 or args.sessions > 64:
        raise CLIError(f"--sessions {args.sessions}: expected 1 to 64", EXIT_USAGE)
    for name in args.agent:
        try:
            session_path(name).stat()
        except OSError:
            raise CLIError(f"no session {name!r} (a shipped name or a file)", EXIT_USAGE) from None
    if settings.no_cache:
        raise CLIError("bench measures the cache: drop --no-cache", EXIT_USAGE)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    from tierchat.core.device import describe_device

    ranks = Ranks.from_args(args)

    runs = agent_bench(
        settings,
        args.agent,
        copies=args.sessions,
        restart_after=args.restart_after,
        max_tokens=args.agent_max_tokens,
        baseline=not args.no_baseline,
        floor_points=args.floor_points,
        fresh_kernel_cache=args.fresh_kernel_cache,
        log=log,
        ranks=ranks,
    )
    device = describe_device() + (f" · {ranks.describe()}" if ranks.launched else "")
    ours = runs[0]
    theirs = runs[1] if len(runs) > 1 else None
    print(
        f"model {settings.model} · {device} · sessions {', '.join(args.agent)} × "
        f"{args.sessions} · restart after {args.restart_after or '-'} · "
        f"max_tokens {args.agent_max_tokens}"
    )
    print(request_table(ours, theirs))
    print()
    print(summary_table(runs))
    for run in runs:
        if run.failure:
            print(f"{run.server} failed after {len(run.requests)} requests: {run.failure}")
    both = ratios(ours, theirs) if theirs else {}
    if both:
        over = f" (the {both['requests']} requests both answered)" if theirs.failure else ""
        tps = both["tokens_per_s"]
        print(
            "tierchat / mlx-lm{}: TTFT median {:.2f}x, p90 {:.2f}x, worst {:.2f}x; "
            "tokens/s {}".format(
                over,
                *(both[k] or 0 for k in ("ttft_median", "ttft_p90", "ttft_worst")),
                "-" if tps is None else f"{tps:.2f}x",
            )
        )
    print(
        "(floor: the server's cold prefill curve T(n)=c0+c1·n+c2·n² from cold requests after "
        "the replay; floor = c0 + T(prompt) − T(prompt − new); * = first request after the "
        "restart; the request rows show the median over the copies)"
    )
    if args.json_out:
        doc = {
            "model": settings.model,
            "device": device,
            "sessions": list(args.agent),
            "copies": args.sessions,
            "restart_after": args.restart_after,
            "max_tokens": args.agent_max_tokens,
            "fresh_kernel_cache": args.fresh_kernel_cache,
            "servers": {r.server: to_json(r) for r in runs},
            "ratios": both,
        }
        try:
            Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            raise CLIError(f"cannot write {args.json_out}: {e.strerror or e}") from None
    return EXIT_OK
