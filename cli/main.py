"""``tierchat``: the command line (docs/DESIGN.md §13).

Subcommands: none (the TUI), ``chat``, ``replay``, ``models``, ``cache stats|clear``,
``config``, ``serve``, ``bench``. The settings flags are accepted before or after the subcommand and
override the config file and ``TIERCHAT_*`` env vars (:func:`load_settings`).

Exit codes: 0 ok; 1 something failed while running (model load, a generation); 2 bad
input (flags, settings, a malformed script, a missing file); 130 interrupted. Errors are
one ``error: ...`` line on stderr, never a traceback (``TIERCHAT_DEBUG=1`` shows one for
an unexpected exception).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from tierchat.cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CLIError,
    error,
    open_store,
    table,
)

# flag dest -> help; every one is a key of config.settings.Settings
SETTING_FLAGS: dict[str, tuple[str, str]] = {
    "model": (
        "SPEC",
        "demo, demo-gemma, tiny:<arch>, shape:<name> (random weights, real shapes), "
        "a .gguf file, an MLX dir or a HF repo id",
    ),
    "cache_dir": ("DIR", "SSD tier directory"),
    "models_dir": ("DIR", "where converted and tiny models are kept"),
    "data_dir": ("DIR", "where the conversation store (SQLite) lives"),
    "block_size": ("TOKENS", "cache block size in tokens"),
    "prefill_chunk": ("TOKENS", "prefill chunk in tokens (mlx-lm's prefill_step_size: 2048)"),
    "prefill_step": (
        "TOKENS",
        "cut prefill chunks at multiples of this (0: auto: on the CPU by model size)",
    ),
    "hot_bytes": ("SIZE", "hot (RAM) tier budget: bytes or 512MB, 6GB, 16GiB"),
    "ssd_bytes": ("SIZE", "SSD tier cap (auto: a whole-context conversation, 16 GiB at least)"),
    "ssd_write_budget": ("SIZE", "SSD bytes written in any 24 hours at most (0: no budget)"),
    "max_tokens": ("N", "reply length limit in tokens"),
    "seed": ("N", "sampling seed (used when temperature > 0)"),
    "temperature": ("T", "sampling temperature (0: greedy)"),
    "top_k": ("K", "sample from the K most likely tokens (0: off)"),
    "min_p": ("P", "drop tokens below P x the top token's probability (0: off)"),
    "repetition_penalty": ("X", "penalize the last 20 tokens' repeats (1: off; 1.1-1.3 typical)"),
    "swipe_temperature": ("T", "temperature of a regenerate at temperature 0 (0: greedy)"),
    "memory_limit": ("SIZE", "memory limit for the prefill guard"),
    "mcp_config": (
        "PATH",
        "MCP servers file, mcp.json notation (default: mcp.json in the config dir)",
    ),
}


def _settings_parser() -> argparse.ArgumentParser:
    # SUPPRESS: a flag not given leaves no attribute, so a subcommand's copy of the flag
    # does not overwrite a value given before the subcommand.
    p = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    g = p.add_argument_group("settings (override the config file and TIERCHAT_* env vars)")
    for dest, (metavar, text) in SETTING_FLAGS.items():
        g.add_argument("--" + dest.replace("_", "-"), dest=dest, metavar=metavar, help=text)
    g.add_argument("--no-cache", dest="no_cache", action="store_true", help="prefix cache off")
    g.add_argument("--config", dest="config", metavar="PATH", help="config file (TOML)")
    r = p.add_argument_group("several ranks (one model across machines, MLX distributed)")
    r.add_argument(
        "--hostfile",
        dest="hostfile",
        metavar="PATH",
        help="run on every host of this mlx.distributed_config hostfile through mlx.launch",
    )
    r.add_argument(
        "--backend",
        dest="backend",
        metavar="NAME",
        help="mlx.launch backend: ring, jaccl, mpi, nccl",
    )
    r.add_argument(
        "--starting-port",
        dest="starting_port",
        type=int,
        metavar="PORT",
        help="mlx.launch ring backend: first port, one more per rank (default 32323)",
    )
    r.add_argument(
        "--rank-timeout",
        dest="rank_timeout",
        type=float,
        metavar="S",
        help="rank 0 fails when a rank makes no progress for S seconds (default 120)",
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    common = _settings_parser()
    parser = argparse.ArgumentParser(
        prog="tierchat",
        description="Terminal chat for local LLMs on MLX with a multi-tier prefix KV cache.",
        epilog="Without a subcommand: the TUI.",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("chat", parents=[common], help="line-mode chat in a plain terminal")
    p.add_argument("--system", metavar="TEXT", help="system prompt of the new conversation")

    p = sub.add_parser(
        "replay",
        parents=[common],
        help="run a scripted session (JSON lines), print one JSON line per generation",
        description="Run a replay script (docs/DESIGN.md §14). Ops: new, user, regenerate, edit, "
        "swipe, restart, clear. Prints one JSON object per generating op, then a summary. "
        "A failed op prints an error line and the script goes on; the exit code is then 1. "
        "Conversations go to a throwaway store unless --data-dir is given.",
    )
    p.add_argument("script", metavar="SCRIPT.jsonl", help="the script ('-' for stdin)")

    p = sub.add_parser(
        "verify",
        parents=[common],
        help="recompute replies with no cache, teacher-forced: agreement with the cached run",
        description="Verify replies against cold (docs/DESIGN.md §18): each reply's prompt "
        "is run teacher-forced on the reply through the cache and twice with no cache; prints "
        "top-1 agreement, the first differing position and max |Δlogprob| of cached vs cold "
        "next to cold vs cold (the device's noise floor), as JSON lines, and stores them "
        "with the replies.",
    )
    p.add_argument(
        "script", nargs="?", metavar="SCRIPT.jsonl", help="a replay script to run and verify"
    )
    p.add_argument("--conversation", type=int, metavar="ID", help="a stored conversation")
    p.add_argument("--node", type=int, metavar="ID", help="one stored reply")

    sub.add_parser("models", parents=[common], help="list the models tierchat can load")

    p = sub.add_parser("cache", parents=[common], help="cache counters, or clear a tier")
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    s = csub.add_parser("stats", parents=[common], help="every counter of the cache")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c = csub.add_parser("clear", parents=[common], help="clear a tier")
    c.add_argument("tier", choices=("hot", "ssd", "tails", "all"))

    sub.add_parser(
        "config",
        parents=[common],
        help="effective settings and their sources, and the device and compute dtype",
    )

    p = sub.add_parser(
        "serve",
        parents=[common],
        help="an OpenAI-, Anthropic- and Responses-compatible HTTP endpoint on the same "
        "engine and cache",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models (OpenAI's API), "
        "/v1/messages and /v1/messages/count_tokens (Anthropic's) and /v1/responses (OpenAI's "
        "Responses API), with tool calls, from one engine and its prefix cache. Requests queue "
        "for the engine. Binding to anything but loopback needs --allow-remote and an API key.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--console", action="store_true", help="show the live console (TUI)")
    p.add_argument(
        "--allow-remote", action="store_true", help="allow a non-loopback --host (needs a key)"
    )
    p.add_argument(
        "--api-key", metavar="KEY", help="require Authorization: Bearer KEY (or TIERCHAT_API_KEY)"
    )
    p.add_argument(
        "--max-queue", type=int, default=64, metavar="N", help="refuse requests past N queued (503)"
    )
    p.add_argument(
        "--system-line-filter",
        action="append",
        metavar="REGEX",
        help="drop system-prompt lines matching REGEX before the prompt is built (repeatable; "
        "replaces the default, which drops Claude Code's per-version "
        "'x-anthropic-billing-header:' line; '' keeps every line)",
    )
    from tierchat.core.serve.limits import add_limit_flags

    add_limit_flags(p)

    p = sub.add_parser(
        "bench",
        parents=[common],
        help="TTFT of cold, hot, SSD and nearest-prefix prefill vs mlx-lm's LRUPromptCache",
    )
    p.add_argument(
        "--lengths",
        default="512,2048,8192",
        metavar="N,N,...",
        help="prompt lengths in tokens (default 512,2048,8192)",
    )
    p.add_argument(
        "--json",
        "--json-out",
        dest="json_out",
        metavar="PATH",
        help="also write every row (and the device, disk read figures) as JSON here",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the mlx-lm LRUPromptCache rows")
    p.add_argument("--extend", type=int, default=32, metavar="N", help="nearest-prefix: new tokens")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        metavar="R",
        help="prompts per length and case; the table shows the median (default 3)",
    )
    p.add_argument(
        "--workload",
        metavar="SCRIPT.jsonl",
        help="instead: replay a chat script (replay ops; 'chat' or 'chat-ci': the shipped "
        "ones) on tierchat and mlx-lm in turn, TTFT and prefilled tokens per op kind",
    )
    p.add_argument(
        "--warmup",
        choices=("none", "unrelated"),
        default="none",
        help="--workload: warm both systems up at unrelated lengths first (default none)",
    )
    p.add_argument(
        "--baseline",
        choices=("lru", "server"),
        default="lru",
        help="--workload: mlx-lm's prompt cache as mlx_lm.server runs it, in this process "
        "(lru, default), or tierchat serve and mlx_lm.server over HTTP, each with its own "
        "replies (server)",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="instead: replay a chat through `tierchat serve` and `mlx_lm.server` (serve_bench)",
    )
    p.add_argument("--turns", type=int, default=4, metavar="N", help="--serve: user turns")
    p.add_argument(
        "--turn-tokens",
        type=int,
        default=None,
        metavar="N",
        help="--serve: tokens per user turn (default 200; with --clients: 100, the first turn)",
    )
    p.add_argument(
        "--clients",
        metavar="N,N,...",
        help="--serve: instead, N concurrent streaming clients per round (e.g. 1,4,8,16) "
        "against tierchat serve and mlx_lm.server: tokens/s and TTFT per N (serve_clients)",
    )
    p.add_argument(
        "--system-tokens",
        type=int,
        default=1500,
        metavar="N",
        help="--serve --clients: the shared system prompt's tokens (default 1500)",
    )
    p.add_argument(
        "--agent",
        nargs="+",
        metavar="SESSION",
        help="instead: replay recorded agent sessions (claude-code, codex, opencode, "
        "claude-code-long, or a file) through tierchat serve and mlx_lm.server: TTFT, "
        "cached tokens, the floor, SSD writes, peak memory per request (agent_bench)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        metavar="N",
        help="--serve --clients, --agent: run each server on N ranks of this host under "
        "mlx.launch (--backend; tierchat sharded, mlx_lm.server with its sharded_load)",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=1,
        metavar="N",
        help="--agent: copies of each session at once, told apart after the first user "
        "message (sub-agents sharing the system prompt and tools; default 1)",
    )
    p.add_argument(
        "--restart-after",
        type=int,
        default=None,
        metavar="K",
        help="--agent: SIGTERM and start each server again after every conversation's K-th request",
    )
    p.add_argument(
        "--agent-max-tokens",
        type=int,
        default=16,
        metavar="N",
        help="--agent: tokens generated per request (default 16)",
    )
    p.add_argument(
        "--floor-points",
        type=int,
        default=4,
        metavar="N",
        help="--agent: cold requests per server for the floor's prefill curve (0: no floor; "
        "default 4)",
    )
    p.add_argument(
        "--fresh-kernel-cache",
        action="store_true",
        help="--agent, --serve --clients: each server with its own empty MLX kernel cache "
        "(MLX_PTX_CACHE_DIR, TMPDIR); with --no-warm-round, the first round as users meet it",
    )
    p.add_argument(
        "--no-warm-round",
        action="store_true",
        help="--serve --clients: skip each server's unreported first round of the most "
        "clients (it builds the GPU kernels of the batch shapes, which MLX keeps on disk "
        "for whichever server runs second)",
    )
    return parser


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings flags given on the command line, for ``load_settings``."""
    out: dict[str, Any] = {k: getattr(args, k) for k in SETTING_FLAGS if hasattr(args, k)}
    if getattr(args, "no_cache", False):
        out["no_cache"] = True
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tierchat`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        from tierchat.cli import ranks
        from tierchat.config.settings import SettingsError, load_settings

        if getattr(args, "hostfile", None) and not ranks.launched():
            argv = list(sys.argv[1:] if argv is None else argv)
            how = (args.hostfile, getattr(args, "backend", None))
            how += (getattr(args, "starting_port", None),)
            if args.command is None or getattr(args, "console", False):
                ranks.start_workers(argv, *how)  # the TUI: this process is rank 0
            else:
                return ranks.relaunch(argv, *how)
        try:
            settings = load_settings(overrides(args), config_path=getattr(args, "config", None))
        except SettingsError as e:
            raise CLIError(str(e), EXIT_USAGE) from None
        if ranks.launched():
            return ranks.run_rank(args, settings, _dispatch, getattr(args, "rank_timeout", None))
        return _dispatch(args, settings)
    except CLIError as e:
        error(e.message)
        return e.code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `tierchat replay s.jsonl | head`
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- silence the flush at exit
        except OSError:
            pass
        return EXIT_FAILED
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        error(f"{where}{e.strerror or e}")
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 -- the last line of defence: no traceback
        if os.environ.get("TIERCHAT_DEBUG"):
            traceback.print_exc()
        error(f"{type(e).__name__}: {e} (TIERCHAT_DEBUG=1 shows a traceback)")
        return EXIT_FAILED


def _dispatch(args: argparse.Namespace, settings: Any) -> int:
    from tierchat.cli import ranks

    command = args.command
    if command is None:
        return run_tui(settings)
    if command == "chat":
        from tierchat.cli.chat import run_chat

        return run_chat(settings, system=args.system)
    if command == "replay":
        from tierchat.cli.replay import run_replay

        return run_replay(settings, args.script, data_dir_given="data_dir" in args)
    if command == "verify":
        from tierchat.cli.verify_cmd import run_verify

        return run_verify(settings, args)
    if command == "models":
        return run_models(settings)
    if command == "cache":
        from tierchat.cli.cache_cmd import run_cache

        return run_cache(settings, args.cache_command, args)
    if command == "config":
        return run_config(settings)
    if command == "serve":
        from tierchat.cli.serve import run_serve

        return run_serve(settings, args)
    if command == "bench" and args.ranks != 1 and not (args.agent or (args.serve and args.clients)):
        raise CLIError("--ranks runs the servers of --serve --clients and --agent", EXIT_USAGE)
    in_process = not (args.agent or args.serve or getattr(args, "baseline", "lru") == "server")
    if command == "bench" and not in_process and ranks.launched():
        raise CLIError(
            "the benches that start servers run them across ranks with --ranks N, not "
            "under mlx.launch (their servers would join this bench's ranks)",
            EXIT_USAGE,
        )
    if command == "bench" and in_process and not args.no_baseline and ranks.launched():
        raise CLIError(
            "across ranks the in-process baseline cannot run (its model is this rank's "
            "shard): add --no-baseline for tierchat's figures on rank 0, or use "
            "--serve --clients / --agent with --ranks N",
            EXIT_USAGE,
        )
    if command == "bench" and args.agent:
        from tierchat.cli.bench.agent_bench import run_agent_bench

        return run_agent_bench(settings, args)
    if command == "bench" and args.serve and args.clients:
        from tierchat.cli.bench.clients import run_clients_bench

        if args.turn_tokens is None:
            args.turn_tokens = 100
        return run_clients_bench(settings, args)
    if command == "bench" and args.clients:
        raise CLIError("--clients needs --serve", EXIT_USAGE)
    if command == "bench" and args.serve:
        if args.turn_tokens is None:
            args.turn_tokens = 200
        from tierchat.cli.bench.serve import run_serve_bench

        return run_serve_bench(settings, args)
    if command == "bench" and args.workload:
        from tierchat.cli.bench.workload_cmd import run_workload_bench

        return run_workload_bench(settings, args)
    if command == "bench":
        from tierchat.cli.bench.main import run_bench

        return run_bench(settings, args)
    raise CLIError(f"unknown command {command!r}", EXIT_USAGE)


def run_tui(settings: Any) -> int:
    """The TUI. The app loads ``settings.model`` itself, showing progress (``run_app``)."""
    try:
        from tierchat.tui.app import run_app
    except ImportError as e:
        raise CLIError(f"the TUI is not available ({e}); try `tierchat chat`") from None
    from tierchat.core.engine.engine import Engine

    host = mcp_host(settings)
    store = open_store(settings.db_path, settings.store_busy_s)
    engine = Engine(settings)
    try:
        run_app(engine, store, settings, mcp_host=host)
    finally:
        engine.close()
        store.close()
    return EXIT_OK


def mcp_host(settings: Any) -> Any:
    """The TUI's MCP host (not started: the app starts it) for the servers of
    ``settings.mcp_path``; None when there are none. Raises :class:`CLIError` (exit 2)
    for a malformed file (docs/DESIGN.md §12.1)."""
    from tierchat.core.tools.config import McpConfigError, load_servers
    from tierchat.core.tools.mcp_host import McpHost

    try:
        servers = load_servers(settings.mcp_path, explicit=settings.mcp_config is not None)
    except McpConfigError as e:
        raise CLIError(str(e), EXIT_USAGE) from None
    return McpHost(servers) if servers else None


def run_models(settings: Any) -> int:
    from tierchat.core.models.loading import list_models

    rows = [
        (m.name, "yes" if m.available else "no", m.description, m.note)
        for m in list_models(settings.models_dir)
    ]
    print(table(rows, ("model", "available", "description", "note")))
    return EXIT_OK


def run_config(settings: Any) -> int:
    from tierchat.config.settings import explain, shown

    rows = [(key, shown(key, v), source) for key, v, source in explain(settings)]
    print(table(rows, ("setting", "value", "source")))
    print(f"device: {_device_line()}")
    return EXIT_OK


def _device_line() -> str:
    """The device and compute dtype (imports MLX); says so when MLX cannot load."""
    try:
        from tierchat.core.device import describe_device
    except ImportError as e:  # a Linux install without tierchat[cpu] or tierchat[cuda]
        return f"unavailable: MLX does not load ({e}); install tierchat[cpu] or tierchat[cuda]"
    return describe_device()


if __name__ == "__main__":
    sys.exit(main())
