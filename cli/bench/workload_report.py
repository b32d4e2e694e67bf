"""The per-op-kind table of ``tierchat bench --workload`` (cli/workload.py, in process)
and ``--baseline server`` (cli/bench/workload_http.py, over HTTP): count, prefilled tokens,
TTFT median, p90 (nearest rank) and worst per system, and the ratio of the medians
(tierchat / the baseline; < 1: tierchat is faster). docs/DESIGN.md §17.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from tierchat.cli.common import table

KINDS: tuple[str, ...] = (
    "new conversation",
    "next user turn",
    "regenerate",
    "edit",
    "turn after the edit",
    "turn after a restart",
)
ALL = "all"
TIERCHAT, MLX_LM = "tierchat", "mlx-lm LRU"
MLX_LM_SERVER = "mlx_lm.server"  # the baseline over HTTP


def p90(values: Sequence[float]) -> float:
    """The 90th percentile by nearest rank: the smallest value with at least 90% of the
    values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def summarize(rows: Sequence[dict], baseline: str = MLX_LM) -> list[dict]:
    """One entry per kind present (in :data:`KINDS` order) and one for all requests:
    ``count``, and per system (``tierchat`` and ``baseline``, the rows' keys)
    ``prefill_tokens`` (sum), ``ttft_median_s``, ``ttft_p90_s``, ``ttft_worst_s``;
    ``ratio`` = tierchat's median / the baseline's (None without it)."""
    out = []
    for kind in (*KINDS, ALL):
        got = [r for r in rows if kind in (ALL, r["kind"])]
        if not got:
            continue
        entry: dict[str, Any] = {"kind": kind, "count": len(got)}
        for system in (TIERCHAT, baseline):
            if system not in got[0]:
                continue
            ttfts = [r[system]["ttft_s"] for r in got]
            entry[system] = {
                "prefill_tokens": sum(r[system]["prefill_tokens"] for r in got),
                "ttft_median_s": statistics.median(ttfts),
                "ttft_p90_s": p90(ttfts),
                "ttft_worst_s": max(ttfts),
            }
        base = entry.get(baseline, {}).get("ttft_median_s")
        entry["ratio"] = entry[TIERCHAT]["ttft_median_s"] / base if base else None
        out.append(entry)
    return out


def ratio_text(ratio: float | None) -> str:
    """``0.42x``; three decimals below 0.1 (a regenerate's ratio is often ~0.003)."""
    if ratio is None:
        return "-"
    return f"{ratio:.3f}x" if ratio < 0.1 else f"{ratio:.2f}x"


def format_summary(summary: Sequence[dict], baseline: str = MLX_LM) -> str:
    def cells(entry: dict, system: str) -> tuple:
        s = entry.get(system)
        if s is None:
            return ("-",) * 4
        times = (s["ttft_median_s"], s["ttft_p90_s"], s["ttft_worst_s"])
        return (s["prefill_tokens"], *(f"{t:.4f}" for t in times))

    rows = [
        (
            e["kind"],
            e["count"],
            *cells(e, TIERCHAT),
            *cells(e, baseline),
            ratio_text(e["ratio"]),
        )
        for e in summary
    ]
    headers = ("op", "n", "tc prefilled", "tc median s", "tc p90 s", "tc worst s")
    headers += ("mlx prefilled", "mlx median s", "mlx p90 s", "mlx worst s", "vs mlx-lm")
    return table(rows, headers)
