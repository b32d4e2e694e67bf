"""What a prefill forward costs on this device, for sizing the scheduler's pieces and
groups (docs/DESIGN.md §20).

A forward of ``n`` tokens takes about ``floor + n / rate`` seconds: ``floor`` is what any
forward costs (reading every weight once, launching its kernels: ~25-50 ms for an 8B model
on a GPU, near 0 on a CPU where compute dominates), ``rate`` the marginal tokens per second.
Tokens per second of each piece alone (``n / t``) mixes the two: a 25-token rest measures
the floor, not the rate, and a scheduler that sized pieces from it would cut a 300-token
turn into block-sized pieces over several steps. :class:`ForwardCost` fits the line by
least squares over the recent forwards (exponentially weighted, so it follows the context
length and the batch), and falls back to the plain ratio (floor 0: pieces no larger than
the average rate allows) while the sizes measured are too alike to fit a slope.
"""

from __future__ import annotations

DECAY = 0.85  # the weight of a forward measured one forward earlier (~7 forwards' memory)
MIN_SPREAD = 0.25  # the sizes' standard deviation over their mean needed to fit a slope


class ForwardCost:
    """Seconds per forward as ``floor + tokens / rate`` from measured forwards
    (:meth:`add`); :meth:`tokens_in` inverts it. Nothing measured: unknown (0 / None)."""

    def __init__(self) -> None:
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """One forward of ``tokens`` tokens (a group: rows x the padded width) that took
        ``seconds`` (to its eval's end). Non-positive values are ignored."""
        if tokens <= 0 or seconds <= 0:
            return
        d = DECAY
        self._w = d * self._w + 1.0
        self._n = d * self._n + tokens
        self._t = d * self._t + seconds
        self._nn = d * self._nn + tokens * tokens
        self._nt = d * self._nt + tokens * seconds

    def fit(self) -> tuple[float, float]:
        """``(floor seconds, seconds per token)``; ``(0, 0)`` before any forward. The least
        squares line through the weighted forwards, its floor clamped to
        ``[0, mean seconds)``; sizes too alike (spread under :data:`MIN_SPREAD`) or a
        slope that is not positive (noise): floor 0 and the mean ratio."""
        if self._w <= 0:
            return 0.0, 0.0
        mn, mt = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mn * mn
        ratio = (0.0, mt / mn)
        if var <= (MIN_SPREAD * mn) ** 2:
            return ratio
        slope = (self._nt / self._w - mn * mt) / var
        if slope <= 0:
            return ratio
        floor = mt - slope * mn
        if floor <= 0:
            return ratio
        return min(floor, mt), slope

    @property
    def rate(self) -> float:
        """The marginal tokens per second (0: unknown)."""
        per_token = self.fit()[1]
        return 1.0 / per_token if per_token > 0 else 0.0

    @property
    def floor(self) -> float:
        """Seconds any forward costs, whatever its size (0: unknown or none seen)."""
        return self.fit()[0]

    def tokens_in(self, seconds: float) -> int | None:
        """The most tokens one forward does in ``seconds`` (at least 1: a forward costs its
        floor however small it is); None before any forward."""
        floor, per_token = self.fit()
        if per_token <= 0:
            return None
        return max(1, int((seconds - floor) / per_token))
