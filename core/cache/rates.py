"""Measured rates that choose, per request, between reading cached entries from the SSD
tier and computing their tokens again.

Which is faster depends on the machine: after a restart on an H100, restoring 3.8K tokens
of a 0.5B model from its disk took 0.34 s while mlx-lm recomputed them in 0.10 s; on a Mac
with a 5-7 GB/s SSD and slower compute the order flips. So the engine measures both on the
machine at hand, as exponentially weighted averages:

- ``prefill_tps``: tokens per second of prefills of at least :data:`MIN_TOKENS` tokens
  (small turns are dominated by a per-forward floor, not by the tokens);
- ``read_bps``: bytes per second of restores that read at least :data:`MIN_BYTES` from
  the SSD tier (file reads, checksums and the copy into the cache: what a restore costs).

They are kept next to the SSD files (one small JSON file per model fingerprint and device),
so the first request after a restart, the one that meets the SSD tier, already has them.
Until both are known the SSD tier is always read (as before rates existed).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

MIN_TOKENS = 512
MIN_BYTES = 1 << 20
WEIGHT = 0.3  # weight of the newest sample in the averages


@dataclass(frozen=True)
class Choice:
    """One request's choice between the SSD tier and recomputing: ``tokens`` that the SSD
    tier would give beyond the RAM tiers, ``nbytes`` to read for them, the estimated
    seconds of each way, and which was taken (``"ssd"`` or ``"recompute"``)."""

    tokens: int
    nbytes: int
    read_s: float
    compute_s: float
    taken: str

    def describe(self) -> str:
        """One line for the per-turn line and the events, e.g.
        ``"ssd 3.8K tok, 48 MiB, est 0.06 s < recompute 0.09 s"``."""
        from ..units import fmt_bytes, fmt_count

        what = f"{fmt_count(self.tokens)} tok, {fmt_bytes(self.nbytes)}"
        if self.taken == "ssd":
            return f"ssd {what}, est {self.read_s:.2f} s < recompute {self.compute_s:.2f} s"
        return f"recompute {what}, est {self.compute_s:.2f} s < ssd {self.read_s:.2f} s"


class Rates:
    """The two averages, loaded from and saved to ``path`` (None: kept in memory only)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.prefill_tps = 0.0
        self.read_bps = 0.0
        if path is not None:
            try:
                raw = json.loads(path.read_text())
                self.prefill_tps = max(0.0, float(raw.get("prefill_tps", 0.0)))
                self.read_bps = max(0.0, float(raw.get("read_bps", 0.0)))
            except (OSError, ValueError, TypeError, AttributeError):
                pass  # missing or unreadable: measured again

    @staticmethod
    def _mix(old: float, new: float) -> float:
        return new if old <= 0 else (1 - WEIGHT) * old + WEIGHT * new

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` took ``seconds`` (ignored below :data:`MIN_TOKENS`)."""
        if tokens >= MIN_TOKENS and seconds > 0:
            self.prefill_tps = self._mix(self.prefill_tps, tokens / seconds)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        """A restore read ``nbytes`` from the SSD tier in ``seconds`` (ignored below
        :data:`MIN_BYTES`)."""
        if nbytes >= MIN_BYTES and seconds > 0:
            self.read_bps = self._mix(self.read_bps, nbytes / seconds)

    def choose(self, tokens: int, nbytes: int) -> Choice | None:
        """Read ``nbytes`` from the SSD tier or compute ``tokens`` again, whichever is
        estimated faster; None while either rate is unknown (then the SSD tier is read)."""
        if tokens <= 0 or self.prefill_tps <= 0 or self.read_bps <= 0:
            return None
        read_s, compute_s = nbytes / self.read_bps, tokens / self.prefill_tps
        taken = "recompute" if compute_s < read_s else "ssd"
        return Choice(tokens, nbytes, read_s, compute_s, taken)

    def save(self) -> None:
        """Write the averages (atomically; a failure leaves the old file)."""
        if self.path is None or (self.prefill_tps <= 0 and self.read_bps <= 0):
            return
        tmp = self.path.with_suffix(f".tmp-{os.getpid()}")
        try:
            data = json.dumps({"prefill_tps": self.prefill_tps, "read_bps": self.read_bps})
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # owner only
            with open(fd, "w") as f:
                f.write(data)
            os.chmod(tmp, 0o600)  # an old tmp of another mode
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
