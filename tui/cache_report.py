"""Words for the cache in the TUI: what a clear asks before it runs, and the alerts a
stats poll raises from two snapshots. Pure Python (no Textual); the report after a clear
is every process's one (:func:`tierchat.core.live_status.clear_report`)."""

from __future__ import annotations

from tierchat.core.api import CacheStats
from tierchat.core.units import fmt_bytes

CLEAR_TEXT: dict[str, tuple[str, str]] = {
    "hot": (
        "Clear the hot tier?",
        (
            "Drops every block held in RAM. Blocks already on the SSD tier stay there, so the "
            "next turn reloads them from disk."
        ),
    ),
    "ssd": (
        "Clear the SSD tier?",
        "Deletes every block file of this model's cache directory. The hot tier is kept.",
    ),
    "tails": (
        "Clear MRU tails and checkpoints?",
        (
            "Drops the partial tails and prompt-end checkpoints; regenerate will prefill the "
            "tail of the prompt again."
        ),
    ),
    "all": (
        "Clear every cache tier?",
        (
            "Drops the hot tier, the SSD tier, tails and checkpoints. The next turn is a cold "
            "prefill of the whole conversation."
        ),
    ),
}


def alerts(before: CacheStats | None, after: CacheStats) -> list[tuple[str, str, str]]:
    """``(severity, title, text)`` for what got worse between two snapshots (disk errors,
    pressure, an uncacheable model); the first snapshot is compared with an empty one."""
    before = before or CacheStats()
    out: list[tuple[str, str, str]] = []
    if after.ssd.errors > before.ssd.errors:
        n = after.ssd.errors - before.ssd.errors
        cap = fmt_bytes(after.ssd.max_bytes)
        reason = f" ({after.ssd.reason})" if after.ssd.reason else ""
        out.append(
            ("error", "SSD tier write failed", f"{n} write error(s){reason}; cap now {cap}.")
        )
    if after.ssd.corrupt > before.ssd.corrupt:
        n = after.ssd.corrupt - before.ssd.corrupt
        out.append(("warning", "SSD tier", f"{n} unreadable block file(s) skipped and removed."))
    if after.memory.level != before.memory.level and after.memory.level in ("soft", "hard"):
        what = {
            "soft": "the hot tier shrinks to make room",
            "hard": "long prefills that would cross the limit are refused",
        }[after.memory.level]
        out.append(
            (
                "warning" if after.memory.level == "soft" else "error",
                f"Memory pressure {after.memory.level}",
                f"{fmt_bytes(after.memory.active)} active of {fmt_bytes(after.memory.limit)}: "
                f"{what}.",
            )
        )
    if after.supported is False and before.supported is not False:
        out.append(("warning", "Cache off", after.reason or "this model cannot be cached"))
    return out
