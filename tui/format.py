"""Plain formatting of sizes, rates and turn metrics for the widgets (no Textual here)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from tierchat.core.api import CACHE_SOURCES, TurnMetrics

SOURCE_LABELS = {
    "hot": "hot",
    "ssd": "SSD",
    "resident": "resident",
    "block": "block",
    "tail": "tail",
    "checkpoint": "checkpoint",
}
_TURN_FIELDS = {f.name for f in fields(TurnMetrics)}


def fmt_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, one decimal from KiB up."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def fmt_count(n: int) -> str:
    """``12345`` -> ``"12,345"``."""
    return f"{n:,}"


def fmt_seconds(s: float) -> str:
    """TTFT-style seconds: ms below one second, else two decimals."""
    if s < 1.0:
        return f"{s * 1000:.0f} ms"
    return f"{s:.2f} s"


def metrics_from_meta(meta: dict[str, Any] | None) -> TurnMetrics | None:
    """The :class:`TurnMetrics` stored in a reply node's ``meta``, if any.

    ``ChatSession`` stores the metrics' fields at the top level of ``meta`` (plus "model");
    a nested ``meta["metrics"]`` dict is read too. Unknown keys are ignored so an older or
    newer store still renders.
    """
    if not meta:
        return None
    raw = meta.get("metrics", meta)
    if isinstance(raw, TurnMetrics):
        return raw
    if not isinstance(raw, dict) or "prompt_tokens" not in raw:
        return None
    known = {k: v for k, v in raw.items() if k in _TURN_FIELDS}
    try:
        return TurnMetrics(**known)
    except TypeError:
        return None


def cache_source_label(metrics: TurnMetrics) -> str:
    """The tier that gave the most cached tokens ("hot", "SSD", ...) or "cold"."""
    source = metrics.cache_source
    return SOURCE_LABELS.get(source, source)


def fmt_cached_by(cached_by: dict[str, int]) -> str:
    """``{"hot": 512, "tail": 40}`` -> ``"hot 512 · tail 40"`` (zero sources left out)."""
    parts = [
        f"{SOURCE_LABELS[s]} {fmt_count(cached_by.get(s, 0))}"
        for s in CACHE_SOURCES
        if cached_by.get(s, 0)
    ]
    return " · ".join(parts) if parts else "none"


def fmt_metrics(m: TurnMetrics) -> str:
    """One line under a reply: source, cached/prefilled tokens, TTFT, decode rate."""
    parts = [
        f"⚡ {cache_source_label(m)}",
        f"cached {fmt_count(m.cached_tokens)}/{fmt_count(m.prompt_tokens)}",
        f"prefilled {fmt_count(m.prefill_tokens)}",
        f"TTFT {fmt_seconds(m.ttft_s)}",
        f"{m.generation_tps:.1f} tok/s",
    ]
    if m.finish_reason == "cancelled":
        parts.append("stopped")
    elif m.finish_reason == "length":
        parts.append("max tokens")
    return " · ".join(parts)
