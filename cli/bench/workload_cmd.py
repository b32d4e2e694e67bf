"""``tierchat bench --workload SCRIPT``: the command (docs/DESIGN.md §17). It replays the
script in a new empty SSD directory inside the cache dir (removed at the end), in this
process against mlx-lm's prompt cache as ``mlx_lm.server`` runs it (cli/bench/workload.py), or
with ``--baseline server`` through ``tierchat serve`` and ``mlx_lm.server`` over HTTP
(cli/bench/workload_http.py); prints the per-kind table (cli/bench/workload_report.py) and writes
``--json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tierchat.cli.bench.main import _fresh_cache_dir
from tierchat.cli.bench.workload import WARMUP_LENGTHS, read_workload, run_workload
from tierchat.cli.bench.workload_http import run_http_workload
from tierchat.cli.bench.workload_report import MLX_LM, MLX_LM_SERVER, format_summary, summarize
from tierchat.cli.common import EXIT_OK, EXIT_USAGE, CLIError


def run_workload_bench(settings: Any, args: Any) -> int:
    """``tierchat bench --workload``: replay the script in a new empty SSD directory inside
    the cache dir (removed at the end), print the per-kind table, write ``--json``."""
    if settings.no_cache:
        raise CLIError("bench measures the cache: drop --no-cache", EXIT_USAGE)
    warmup = getattr(args, "warmup", "none")
    path, ops = read_workload(args.workload)

    def log(text: str) -> None:
        print(f"bench: {text}", file=sys.stderr, flush=True)

    over_http = getattr(args, "baseline", "lru") == "server"
    # greedy, whatever the config file says
    settings.sampling = dataclasses.replace(settings.sampling, temperature=0.0)
    with _fresh_cache_dir(Path(settings.cache_dir), log) as tmp:
        settings.cache_dir = tmp
        log(f"workload {path}; model {settings.model}, block size {settings.block_size}")
        how = {"baseline": not args.no_baseline, "warmup": warmup == "unrelated", "log": log}
        if over_http:
            with tempfile.TemporaryDirectory(prefix="tierchat-workload-http-") as work:
                result = run_http_workload(settings, ops, path, Path(work), **how)
        else:
            result = run_workload(settings, ops, path, **how)
    from tierchat.core.device import describe_device, device_info

    label = MLX_LM_SERVER if over_http else MLX_LM
    summary = summarize(result.rows, label)
    device = describe_device(result.dtype)
    same_key = "same_text" if over_http else "same_tokens"
    same = [r[same_key] for r in result.rows if r[same_key] is not None]
    print(f"model {settings.model} · block size {settings.block_size} · {device}")
    print(f"workload {path}: {len(result.rows)} requests; warm-up: {warmup}")
    print(format_summary(summary, label))
    if over_http:
        note = f"({result.wall_s:.1f} s; through HTTP, each server with its own replies: "
        note += "tc = tierchat serve, mlx = mlx_lm.server (defaults); "
    else:
        note = f"({result.wall_s:.1f} s; tc = tierchat, mlx = mlx-lm LRUPromptCache as "
        note += "mlx_lm.server runs it; "
    note += "vs mlx-lm = tierchat median TTFT / mlx-lm median TTFT"
    if same:
        what = "text" if over_http else "tokens"
        note += f"; same reply {what} in {sum(same)} of {len(same)} requests"
    print(note + ")")
    if args.json_out:
        doc = {
            "model": settings.model,
            "baseline": label,
            "block_size": settings.block_size,
            "prefill_chunk": settings.prefill_chunk,
            "device": device,
            "device_info": device_info(result.dtype)._asdict(),
            "workload": path,
            "warmup": warmup,
            "warmup_lengths": list(WARMUP_LENGTHS) if warmup == "unrelated" else [],
            "wall_s": result.wall_s,
            "summary": summary,
            "rows": result.rows,
        }
        try:
            Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            raise CLIError(f"cannot write {args.json_out}: {e.strerror or e}") from None
    return EXIT_OK
