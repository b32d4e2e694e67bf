"""Formatting for the widgets only: tier/kind labels, rates, turn metrics, think blocks.

Sizes, counts and durations come from :mod:`tierchat.core.units` (one form everywhere);
no Textual here."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from tierchat.core.api import CACHE_KINDS, CACHE_SOURCES, TurnMetrics
from tierchat.core.chat.verify import VerifyReport
from tierchat.core.units import fmt_bytes, fmt_count, fmt_seconds

SOURCE_LABELS = {
    "hot": "hot",
    "ssd": "SSD",
    "resident": "resident",
    "block": "block",
    "tail": "tail",
    "checkpoint": "checkpoint",
}
_TURN_FIELDS = {f.name for f in fields(TurnMetrics)}


def verify_line(meta: dict[str, Any] | None) -> str:
    """The stored verify-against-cold report of a reply (``meta["verify"]``,
    :mod:`tierchat.core.chat.verify`) as one line, "" when there is none or it is unreadable."""
    raw = (meta or {}).get("verify")
    if not isinstance(raw, dict):
        return ""
    try:
        return VerifyReport.from_dict(raw).describe()
    except (KeyError, TypeError, ValueError):
        return ""


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


def cache_kind_label(metrics: TurnMetrics) -> str:
    """The entry kind that gave the most cached tokens ("block", "checkpoint", ...), or ""."""
    kinds = metrics.cached_kind or {}
    if not metrics.cached_tokens or not any(kinds.values()):
        return ""
    best = max(kinds, key=lambda k: kinds[k])
    return SOURCE_LABELS.get(best, best)


def _fmt_split(counts: dict[str, int], order: tuple[str, ...]) -> str:
    parts = [f"{SOURCE_LABELS[s]} {fmt_count(counts.get(s, 0))}" for s in order if counts.get(s, 0)]
    return " · ".join(parts) if parts else "none"


def fmt_cached_by(cached_by: dict[str, int]) -> str:
    """Cached tokens by tier: ``{"hot": 512, "ssd": 40}`` -> ``"hot 512 · SSD 40"``."""
    return _fmt_split(cached_by, CACHE_SOURCES)


def fmt_cached_kind(cached_kind: dict[str, int]) -> str:
    """Cached tokens by entry kind: ``"block 512 · checkpoint 1"`` (zeros left out)."""
    return _fmt_split(cached_kind, CACHE_KINDS)


MIN_RATE_TOKENS = 16
"""Below this many tokens a tok/s figure measures overhead, not throughput: shown as —."""


def fmt_rate(tps: float, tokens: int) -> str:
    """``"412.3 tok/s"``, or ``"— (1 token)"`` when too few tokens were timed."""
    if tokens < MIN_RATE_TOKENS:
        return f"— ({tokens} token{'' if tokens == 1 else 's'})"
    return f"{tps:.1f} tok/s"


def fmt_metrics(m: TurnMetrics) -> str:
    """One line under a reply: tier and entry kind, cached/prefilled tokens, TTFT, rate."""
    kind = cache_kind_label(m)
    parts = [
        f"⚡ {cache_source_label(m)}{' ' + kind if kind else ''}",
        f"cached {fmt_count(m.cached_tokens)}/{fmt_count(m.prompt_tokens)}",
        f"prefilled {fmt_count(m.prefill_tokens)}",
        f"TTFT {fmt_seconds(m.ttft_s)}",
        f"{m.generation_tps:.1f} tok/s",
    ]
    if m.restore_choice:  # e.g. "ssd 3.8K tok, 48 MiB, est 0.06 s < recompute 0.09 s"
        parts.append(m.restore_choice)
    if m.ssd_write_bytes:  # files this turn handed to the SSD writer
        parts.append(f"SSD +{fmt_bytes(m.ssd_write_bytes)}")
    if m.finish_reason == "cancelled":
        parts.append("stopped")
    elif m.finish_reason == "length":
        parts.append("max tokens")
    return " · ".join(parts)


_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_LEADING_WS = re.compile(r"^\s*")


def split_think(text: str) -> tuple[str | None, str, bool]:
    """``(reasoning, answer, closed)`` of a reply that may start with ``<think>…</think>``.

    ``reasoning`` is None when the reply has no think block; ``closed`` is False while the
    block is still open (streaming). Some templates put ``<think>`` in the generation
    prompt, so a reply holding only ``…</think>`` counts as reasoning too.
    """
    start = len(_LEADING_WS.match(text).group(0))
    body = text[start:]
    if body.startswith(_THINK_OPEN):
        rest = body[len(_THINK_OPEN) :]
        end = rest.find(_THINK_CLOSE)
        if end < 0:
            return rest.strip(), "", False
        return rest[:end].strip(), rest[end + len(_THINK_CLOSE) :].lstrip(), True
    end = text.find(_THINK_CLOSE)
    if end >= 0 and _THINK_OPEN not in text[:end]:
        return text[:end].strip(), text[end + len(_THINK_CLOSE) :].lstrip(), True
    return None, text, True
