"""The figures of ``tierchat bench --agent`` (docs/DESIGN.md §17): per-request records, the
floor, and the side-by-side table. Pure: no server, no model, no clock.

The floor of a request is the time its server needs to prefill only the request's *new*
tokens (those after its longest common prefix with the previous request of the same
conversation) at their place in the context, plus the server's fixed cost of a request.
It comes from the server's own cold prefills: after the replay each server answers cold
requests of unrelated text at a few lengths from 256 tokens to the session's longest
prompt, and
:func:`fit_prefill_curve` fits ``T(n) = c0 + c1·n + c2·n²`` (seconds for a cold ``n``-token
prompt: weights linear in ``n``, attention quadratic) by least squares of the relative
errors with every coefficient ≥ 0. Then ``floor(context L, new k) = c0 + T(L) − T(L − k)``
(the marginal cost of the last ``k`` tokens of an ``L``-token prefill) and the cold
estimate is ``T(L)``. A request with every token new has floor ``T(L)``; one with none
new, ``c0``.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from tierchat.cli.bench.workload_report import p90, ratio_text
from tierchat.cli.common import table
from tierchat.core.units import fmt_bytes

ServerName = Literal["tierchat", "mlx-lm"]
TIERCHAT: ServerName = "tierchat"
MLX_LM: ServerName = "mlx-lm"
Phase = Literal["before", "after"]


@dataclass(frozen=True)
class PrefillCurve:
    """``T(n) = c0 + c1·n + c2·n²`` seconds: a server's cold TTFT for an ``n``-token prompt
    (:func:`fit_prefill_curve`)."""

    c0: float
    c1: float
    c2: float

    def cold_s(self, n: int) -> float:
        """Seconds for a cold ``n``-token prompt."""
        return self.c0 + self.c1 * n + self.c2 * n * n

    def floor_s(self, context: int, new: int) -> float:
        """Seconds to prefill the last ``new`` tokens of a ``context``-token prompt whose
        prefix is already cached, plus the fixed cost ``c0``. ``new`` is clamped to
        ``[0, context]``."""
        new = max(0, min(new, context))
        return self.c0 + self.c1 * new + self.c2 * (context * context - (context - new) ** 2)


def _weight(t: float) -> float:
    """A point's weight in the fit: ``1/t²``, so that each point's *relative* error counts
    (a 30 s cold prefill would otherwise outweigh a 0.1 s one 10⁵ times, and the short
    points are what pins ``c0`` and ``c1``, the floor of a turn with few new tokens)."""
    return 1.0 / max(t, 1e-6) ** 2


def _solve(points: Sequence[tuple[int, float]], terms: tuple[int, ...]) -> list[float] | None:
    """Weighted least squares (:func:`_weight`) of ``ttft ≈ Σ c_j n^j`` over ``j in
    terms`` (normal equations, tiny systems); None when singular."""
    k = len(terms)
    a = [[sum(_weight(t) * float(n) ** (i + j) for n, t in points) for j in terms] for i in terms]
    b = [sum(_weight(t) * float(n) ** i * t for n, t in points) for i in terms]
    for col in range(k):  # Gaussian elimination with partial pivoting
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            return None
        a[col], a[piv], b[col], b[piv] = a[piv], a[col], b[piv], b[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(k)]


def fit_prefill_curve(points: Sequence[tuple[int, float]]) -> PrefillCurve:
    """The :class:`PrefillCurve` through ``points`` (``(prompt tokens, cold TTFT s)``):
    least squares of the relative errors over every subset of the three terms, keeping the
    best fit whose coefficients are all ≥ 0 (one point: a line through the origin).

    Raises:
        ValueError: no points, or a point with fewer than 1 token or a negative time.
    """
    if not points or any(n < 1 or t < 0 for n, t in points):
        raise ValueError(f"need cold prefills of >= 1 token and >= 0 s, got {list(points)}")
    best: tuple[float, PrefillCurve] | None = None
    for size in (3, 2, 1):
        for terms in itertools.combinations((0, 1, 2), size):
            if len(terms) > len({n for n, _ in points}) or 0 in terms and size == 1:
                continue
            coef = _solve(points, terms)
            if coef is None or any(c < 0 for c in coef):
                continue
            c = dict(zip(terms, coef, strict=True))
            curve = PrefillCurve(c.get(0, 0.0), c.get(1, 0.0), c.get(2, 0.0))
            err = sum(_weight(t) * (curve.cold_s(n) - t) ** 2 for n, t in points)
            if best is None or err < best[0] - 1e-15:
                best = (err, curve)
    if best is None:  # every time 0
        return PrefillCurve(0.0, 0.0, 0.0)
    return best[1]


def new_tokens(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Per prompt of one conversation, its tokens after the longest common prefix with the
    prompt before it (the first: all of its tokens)."""
    out, previous = [], None
    for ids in prompts:
        shared = 0
        if previous is not None:
            for a, b in zip(ids, previous, strict=False):
                if a != b:
                    break
                shared += 1
        out.append(len(ids) - shared)
        previous = ids
    return out


@dataclass(frozen=True)
class AgentRequest:
    """One request of one conversation on one server, as the bench saw it.

    ``index``: the request's place in its recorded session; ``copy``: which of the
    ``--sessions`` copies; ``phase``: before or after the restart. Tokens as the server
    reported them (``cached``: ``prompt_tokens_details.cached_tokens`` or Anthropic's
    ``cache_read_input_tokens``); ``new``: as :func:`new_tokens` counts them with the
    model's chat template. Times in seconds from the request's send: ``ttft_s`` to the first
    streamed event of the reply, ``done_s`` to its end. ``floor_s`` / ``cold_s``: from the
    server's :class:`PrefillCurve` (None when not measured). ``ssd_bytes``: what the
    server's SSD tier wrote between the previous reading and this request's end (None: the
    server has no SSD tier)."""

    server: ServerName
    session: str
    copy: int
    index: int
    phase: Phase
    api: str
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    completion_tokens: int
    sent_s: float
    ttft_s: float
    done_s: float
    floor_s: float | None = None
    cold_s: float | None = None
    ssd_bytes: int | None = None

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def over_floor(self) -> float | None:
        return self.ttft_s / self.floor_s if self.floor_s else None


@dataclass
class ServerRun:
    """What one server did over the whole replay: its requests, the curve behind the
    floors, the restart, memory peaks (bytes; None where not available) and SSD writes."""

    server: ServerName
    requests: list[AgentRequest] = field(default_factory=list)
    curve: PrefillCurve | None = None
    calibration: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0
    peak_rss_bytes: int | None = None
    peak_gpu_bytes: int | None = None
    peak_mlx_bytes: int | None = None
    ssd_bytes: int | None = None
    restarts: int = 0
    failure: str = ""  # what ended the replay early ("" when it ran to the end)

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(r.completion_tokens for r in self.requests)
        return tokens / self.wall_s if self.wall_s > 0 else 0.0


def _worst(rows: Sequence[AgentRequest], key) -> AgentRequest:
    return max(rows, key=key)


def summarize(run: ServerRun) -> dict:
    """The server's headline figures: TTFT median / p90 / worst (with which request), TTFT
    over floor median and worst, the first request after the restart (TTFT, cached share,
    over the cold estimate), tokens/s, SSD bytes and memory peaks."""
    rows = run.requests
    out: dict = {"server": run.server, "requests": len(rows)}
    if not rows:
        return out
    ttfts = [r.ttft_s for r in rows]
    worst = _worst(rows, lambda r: r.ttft_s)
    out |= {
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": p90(ttfts),
        "ttft_worst_s": worst.ttft_s,
        "ttft_worst_request": f"{worst.session}#{worst.index} copy {worst.copy}",
        "tokens_per_s": run.tokens_per_s,
        "prefilled_tokens": sum(r.prefilled for r in rows),
        "new_tokens": sum(r.new_tokens for r in rows),
    }
    floors = [r for r in rows if r.over_floor is not None]
    if floors:
        bad = _worst(floors, lambda r: r.over_floor)
        out |= {
            "over_floor_median": statistics.median(r.over_floor for r in floors),
            "over_floor_worst": bad.over_floor,
            "over_floor_worst_request": f"{bad.session}#{bad.index} copy {bad.copy}",
        }
    after = [r for r in rows if r.phase == "after"]
    if after:
        first = min(after, key=lambda r: (r.index, r.sent_s))
        firsts = [r for r in after if r.index == first.index]
        out["restart"] = {
            "index": first.index,
            "ttft_s": max(r.ttft_s for r in firsts),
            "cached_share": min(r.cached_tokens / max(1, r.prompt_tokens) for r in firsts),
            "over_cold": (
                max(r.ttft_s / r.cold_s for r in firsts if r.cold_s)
                if all(r.cold_s for r in firsts)
                else None
            ),
        }
    out |= {
        "ssd_bytes": run.ssd_bytes,
        "peak_rss_bytes": run.peak_rss_bytes,
        "peak_gpu_bytes": run.peak_gpu_bytes,
        "peak_mlx_bytes": run.peak_mlx_bytes,
    }
    return out


def _by_index(run: ServerRun | None) -> dict[tuple[str, int], list[AgentRequest]]:
    out: dict[tuple[str, int], list[AgentRequest]] = {}
    for r in run.requests if run else []:
        out.setdefault((r.session, r.index), []).append(r)
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def request_table(ours: ServerRun, theirs: ServerRun | None) -> str:
    """One row per request of the session (the median over its ``--sessions`` copies):
    tokens, then per server TTFT, cached tokens, floor and TTFT over floor, then tierchat's
    TTFT over mlx-lm's. A ``*`` marks the first request after the restart."""
    mine, other = _by_index(ours), _by_index(theirs)
    lines = []
    for key in sorted(mine, key=lambda k: (k[0], k[1])):
        a = mine[key]
        b = other.get(key, [])

        def med(rows, attr):
            vals = [getattr(r, attr) for r in rows if getattr(r, attr) is not None]
            return statistics.median(vals) if vals else None

        restart = (
            "*"
            if a[0].phase == "after"
            and key[1]
            == min(
                (r.index for r in ours.requests if r.phase == "after" and r.session == key[0]),
                default=-1,
            )
            else ""
        )
        ta, tb = med(a, "ttft_s"), med(b, "ttft_s")
        lines.append(
            (
                f"{key[0]}#{key[1]}{restart}",
                int(med(a, "prompt_tokens")),
                int(med(a, "new_tokens")),
                _f(ta),
                int(med(a, "cached_tokens")),
                _f(med(a, "floor_s")),
                ratio_text(ta / med(a, "floor_s")) if med(a, "floor_s") else "-",
                _f(tb),
                "-" if not b else int(med(b, "cached_tokens")),
                _f(med(b, "floor_s")) if b else "-",
                ratio_text(tb / med(b, "floor_s")) if b and med(b, "floor_s") else "-",
                ratio_text(ta / tb) if tb else "-",
            )
        )
    headers = (
        "request",
        "prompt",
        "new",
        "TTFT s",
        "cached",
        "floor s",
        "/floor",
        "mlx-lm TTFT s",
        "cached",
        "floor s",
        "/floor",
        "vs mlx-lm",
    )
    return table(lines, headers)


def summary_table(runs: Sequence[ServerRun]) -> str:
    """One row per server: TTFT median / p90 / worst, over floor median / worst, the
    restart request, tokens/s, SSD written, memory peaks."""
    lines = []
    for run in runs:
        s = summarize(run)
        if not run.requests:
            continue
        restart = s.get("restart")
        lines.append(
            (
                run.server,
                s["requests"],
                _f(s["ttft_median_s"]),
                _f(s["ttft_p90_s"]),
                f"{s['ttft_worst_s']:.2f} ({s['ttft_worst_request']})",
                ratio_text(s.get("over_floor_median")),
                ratio_text(s.get("over_floor_worst")),
                "-"
                if restart is None
                else f"{restart['ttft_s']:.2f} s, {restart['cached_share']:.0%} cached, "
                f"{ratio_text(restart['over_cold'])} cold",
                f"{s['tokens_per_s']:.1f}",
                "-" if s["ssd_bytes"] is None else fmt_bytes(s["ssd_bytes"]),
                "-" if s["peak_rss_bytes"] is None else fmt_bytes(s["peak_rss_bytes"]),
                "-" if s["peak_gpu_bytes"] is None else fmt_bytes(s["peak_gpu_bytes"]),
                "-" if s["peak_mlx_bytes"] is None else fmt_bytes(s["peak_mlx_bytes"]),
            )
        )
    headers = (
        "server",
        "requests",
        "TTFT median s",
        "p90 s",
        "worst s",
        "/floor median",
        "/floor worst",
        "after restart",
        "tok/s",
        "SSD written",
        "peak RSS",
        "peak GPU",
        "peak MLX",
    )
    return table(lines, headers)


def ratios(ours: ServerRun, theirs: ServerRun) -> dict:
    """tierchat's figures over mlx-lm's: TTFT median and p90 and worst, tokens/s. When
    mlx-lm's replay ended early (``failure``), over the requests both answered, and no
    tokens/s (its wall time covers only part of the session)."""
    if theirs.failure:
        answered = {(r.session, r.index, r.copy) for r in theirs.requests}
        ours = replace(
            ours, requests=[r for r in ours.requests if (r.session, r.index, r.copy) in answered]
        )
    a, b = summarize(ours), summarize(theirs)
    if "ttft_median_s" not in a or "ttft_median_s" not in b:
        return {}
    div = lambda x, y: x / y if y else None  # noqa: E731
    return {
        "ttft_median": div(a["ttft_median_s"], b["ttft_median_s"]),
        "ttft_p90": div(a["ttft_p90_s"], b["ttft_p90_s"]),
        "ttft_worst": div(a["ttft_worst_s"], b["ttft_worst_s"]),
        "tokens_per_s": None if theirs.failure else div(a["tokens_per_s"], b["tokens_per_s"]),
        "requests": a["requests"],
    }


def to_json(run: ServerRun) -> dict:
    """``run`` as plain JSON: its summary, curve, calibration points and every request."""
    return {
        "summary": summarize(run),
        "curve": None if run.curve is None else asdict(run.curve),
        "calibration": [list(p) for p in run.calibration],
        "restarts": run.restarts,
        "failure": run.failure,
        "requests": [
            asdict(r) | {"prefilled": r.prefilled, "over_floor": r.over_floor} for r in run.requests
        ],
    }
