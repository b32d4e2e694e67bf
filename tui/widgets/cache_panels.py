"""The live cache console: memory, hot tier, SSD tier, MRU tails, snapshots, last turn and
an event log, all fed from one :class:`~tierchat.core.api.CacheStats` snapshot.

:class:`CachePanels` holds one reactive, ``stats``; its watcher fans the snapshot out to the
panels (``ProgressBar.update``, a hit-rate sparkline, ``Log``).
Polling is the screen's job (one ``set_interval``, paused while the panels are hidden).
"""

from __future__ import annotations

from collections import deque

from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.clock import Clock
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.widgets import ProgressBar, RichLog, Static
from tierchat.core.api import CacheStats, LookupStats, MemoryStats, TailStats, TierStats, WearStats
from tierchat.core.units import fmt_bytes, fmt_count, fmt_seconds
from tierchat.tui.format import fmt_cached_by, fmt_cached_kind, fmt_rate

SPARK_POINTS = 40
LINE_WIDTH = 40
"""Columns of a panel's text inside the fixed-width panels (``CachePanels`` 46 wide, less
padding, a scrollbar, a border and the panel's padding)."""


def fit_parts(parts: list[str], width: int) -> str:
    """``parts`` joined by " · ", with a line break instead of a separator wherever the
    next part would pass ``width`` columns (a part wider than that alone is left whole)."""
    lines: list[str] = []
    line = ""
    for part in (p for p in parts if p):
        joined = f"{line} · {part}" if line else part
        if line and cell_len(joined) > width:
            lines.append(line)
            line = part
        else:
            line = joined
    if line or not lines:
        lines.append(line)
    return "\n".join(lines)


class Panel(Vertical):
    """A bordered box with a title; subclasses implement :meth:`show`."""

    DEFAULT_CSS = """
    Panel {
        height: auto;
        border: round $primary 40%;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0 1;
    }
    Panel > .line { height: auto; width: 1fr; }
    Panel > .na { color: $warning; width: 1fr; }
    Panel ProgressBar { width: 1fr; height: 1; }
    Panel ProgressBar > Bar { width: 1fr; }
    Panel.-off > .when-on { display: none; }
    Panel > .na { display: none; }
    Panel.-off > .na { display: block; }
    """

    TITLE = ""

    def __init__(self, *, clock: Clock | None = None, id: str | None = None) -> None:
        super().__init__(id=id)
        self._clock = clock
        self.border_title = self.TITLE

    def gauge(self, id: str) -> ProgressBar:
        bar = ProgressBar(total=1, show_eta=False, show_percentage=True, clock=self._clock, id=id)
        bar.add_class("when-on")
        return bar

    @staticmethod
    def set_gauge(bar: ProgressBar, value: int, total: int) -> None:
        # total=0 would make ProgressBar indeterminate (animated); show an empty bar instead.
        bar.update(total=max(total, 1), progress=min(value, max(total, 1)))

    def put(self, selector: str, parts: list[str]) -> None:
        """Show ``parts`` in the ``.line`` Static ``selector``, joined by " · " and broken
        into lines between parts so that none is wider than the Static (the panels'
        width is fixed: :data:`LINE_WIDTH` until it is laid out)."""
        static = self.query_one(selector, Static)
        width = static.content_region.width or LINE_WIDTH
        static.update(fit_parts(parts, width))

    def set_off(self, reason: str | None) -> None:
        """Show "N/A" with ``reason`` instead of the readings (None: readings)."""
        self.set_class(reason is not None, "-off")
        if reason is not None:
            self.query_one(".na", Static).update(f"N/A — {reason}" if reason else "N/A")

    def show(self, stats: CacheStats) -> None:
        raise NotImplementedError


class MemoryPanel(Panel):
    TITLE = "Memory"
    DEFAULT_CSS = """
    MemoryPanel.-soft { border: round $warning; }
    MemoryPanel.-hard { border: round $error; }
    """

    def compose(self) -> ComposeResult:
        yield self.gauge("memory-gauge")
        yield Static("", classes="line", id="memory-text", markup=False)
        yield Static("", classes="line", id="memory-peak", markup=False)

    def show(self, stats: CacheStats) -> None:
        m: MemoryStats = stats.memory
        self.set_gauge(self.query_one("#memory-gauge", ProgressBar), m.active, m.limit)
        limit = f"{fmt_bytes(m.limit)} ({ceiling_source(m)})" if m.limit else "no limit"
        self.put("#memory-text", [f"active {fmt_bytes(m.active)} / {limit}"])
        self.put("#memory-peak", [f"peak {fmt_bytes(m.peak)}", f"MLX cache {fmt_bytes(m.cache)}"])
        for level in ("ok", "soft", "hard"):
            self.set_class(m.level == level, f"-{level}")
        self.border_subtitle = f"pressure {m.level}"


def ceiling_source(m: MemoryStats) -> str:
    """What bounds the memory ceiling now: ``"limit"`` (``--memory-limit`` or 90% of the
    device) or ``"free RAM"`` (what this process holds plus what the system has free,
    which moves as other programs take or give back memory; core/memory/pressure.py)."""
    in_use = m.active + m.cache
    if m.system_total > 0 and m.limit == in_use + m.system_available:
        return "free RAM"
    return "limit"


class TierPanel(Panel):
    """Hot or SSD tier: bytes against the budget, entries and counters."""

    def __init__(self, tier: str, title: str, *, clock: Clock | None = None) -> None:
        self.tier = tier
        self.TITLE = title
        super().__init__(clock=clock, id=f"{tier}-panel")

    def compose(self) -> ComposeResult:
        yield Static("", classes="na", markup=False)
        yield self.gauge(f"{self.tier}-gauge")
        yield Static("", classes="line when-on", id=f"{self.tier}-size", markup=False)
        yield Static("", classes="line when-on", id=f"{self.tier}-counters", markup=False)
        if self.tier == "hot":
            yield Static("", classes="line when-on", id="hot-resident", markup=False)
        else:
            yield Static("", classes="line when-on", id="ssd-writes", markup=False)

    def show(self, stats: CacheStats, loading: str = "") -> None:
        t: TierStats = getattr(stats, self.tier)
        off = not (stats.enabled and t.enabled) or stats.supported is False
        if loading:
            self.set_off(f"loading {loading}…")
        else:
            self.set_off((t.reason or stats.reason or "caching off") if off else None)
        self.set_gauge(self.query_one(ProgressBar), t.nbytes, t.max_bytes)
        noun = "entries" if self.tier == "hot" else "files"
        self.put(
            f"#{self.tier}-size",
            [f"{fmt_bytes(t.nbytes)} / {fmt_bytes(t.max_bytes)}", f"{fmt_count(t.entries)} {noun}"],
        )
        if self.tier == "hot":
            # hits count every hot entry used: blocks and MRU tails (core/api.py); the
            # resident cache (the last request's, reused in place) is RAM too, counted apart.
            # Evicted: every entry the tier dropped, blocks (hot.evictions) and tails and
            # checkpoints (tails.evictions), as the Events log counts them.
            # Per-block misses are left out here: a turn served from the resident cache
            # misses every block it never looked up. Turn-level hits: the Hits panel.
            evicted = t.evictions + stats.tails.evictions
            counters = [f"entries used {fmt_count(t.hits)}", f"evicted {fmt_count(evicted)}"]
            r = getattr(stats, "resident", None)
            if r is not None:
                self.put(
                    "#hot-resident",
                    [
                        f"resident {fmt_count(r.tokens)} tok",
                        fmt_bytes(r.nbytes),
                        f"hits {fmt_count(r.hits)}",
                    ],
                )
        else:
            counters = [
                f"read {fmt_count(t.hits)}",
                f"queue {t.queue_depth}",
                f"errors {fmt_count(t.errors)}",
                f"drops {fmt_count(t.write_drops)}",
                f"corrupt {fmt_count(t.corrupt)}" if t.corrupt else "",
            ]
            self.put("#ssd-writes", fmt_wear(stats.wear))
        self.put(f"#{self.tier}-counters", counters)


def fmt_wear(w: WearStats) -> list[str]:
    """The SSD panel's parts of bytes written (docs/DESIGN.md §8.6): this session, in
    total, the last 24 hours against the budget, and what admission deferred or skipped."""
    day = fmt_bytes(w.day_bytes) + (f" of {fmt_bytes(w.budget_bytes)}" if w.budget_bytes else "")
    parts = [f"written {fmt_bytes(w.session_bytes)}", f"total {fmt_bytes(w.total_bytes)}"]
    parts.append(f"24 h {day}")
    if w.deferred:
        parts.append(f"deferred {fmt_count(w.deferred)}")
    if w.skipped:
        parts.append(f"skipped {fmt_count(w.skipped)} ({fmt_bytes(w.skipped_bytes)})")
    if w.budget_skips:
        parts.append(f"over budget {fmt_count(w.budget_skips)}")
    return parts


SPARK_BARS = "▁▂▃▄▅▆▇█"


def fmt_lookups(lk: LookupStats) -> tuple[list[str], list[str]]:
    """Two lines' parts: the hit rate over turns, and where the hits came from."""
    if not lk.lookups:
        return ["no turn yet"], []
    n = fmt_count
    rate = [
        f"hit rate {lk.hit_rate:.0%} ({n(lk.hits)}/{n(lk.lookups)} turns)",
        f"cold {n(lk.cold)}",
    ]
    split = [f"resident {n(lk.resident)}", f"hot {n(lk.hot)}", f"SSD {n(lk.ssd)}"]
    return rate, [*split, f"via tail {n(lk.tail)}"]


class HitsPanel(Panel):
    """Turns by where their cached prefix came from: every kind of hit (resident, hot
    entries, SSD, tails) against cold turns, one count per turn (not per block)."""

    TITLE = "Hits"

    def compose(self) -> ComposeResult:
        yield Static("", classes="na", markup=False)
        yield Static("", classes="line when-on", id="hits-rate", markup=False)
        yield Static("", classes="line when-on", id="hits-split", markup=False)

    def show(self, stats: CacheStats) -> None:
        if stats.supported is False or not stats.enabled:
            self.set_off(stats.reason or "caching off")
            return
        self.set_off(None)
        rate, split = fmt_lookups(stats.lookups)
        self.put("#hits-rate", rate)
        self.put("#hits-split", split)


class RateSparkline(Static):
    """Rates in [0, 1] as one bar per sample on a fixed 0..100% scale, newest on the right.

    Textual's ``Sparkline`` scales to the data's own min..max, so a steady 0% hit rate
    would draw full bars; a hit rate needs an absolute scale.
    """

    DEFAULT_CSS = """
    RateSparkline { height: 1; width: 1fr; color: $success; }
    """

    def show(self, rates: list[float]) -> None:
        bars = "".join(
            SPARK_BARS[round(max(0.0, min(1.0, r)) * (len(SPARK_BARS) - 1))] for r in rates
        )
        self.update(Content(bars))


class TailsPanel(Panel):
    """MRU partial tails: entries, hit rate with a sparkline of it over lookups, tokens saved."""

    TITLE = "MRU tails"

    def __init__(self, *, clock: Clock | None = None) -> None:
        super().__init__(clock=clock, id="tails-panel")
        self._rates: deque[float] = deque(maxlen=SPARK_POINTS)
        self._lookups = 0

    def compose(self) -> ComposeResult:
        yield Static("", classes="na", markup=False)
        yield Static("", classes="line when-on", id="tails-entries", markup=False)
        yield RateSparkline("", id="tails-spark", classes="when-on")
        yield Static("", classes="line when-on", id="tails-saved", markup=False)

    def show(self, stats: CacheStats) -> None:
        t: TailStats = stats.tails
        if t.supported is False or stats.supported is False:
            self.set_off(t.reason or stats.reason or "this model cannot use tails")
            return
        self.set_off(None)
        lookups = t.hits + t.misses
        if lookups != self._lookups:
            # One point per change in lookups: the line moves with traffic, not wall time.
            self._lookups = lookups
            self._rates.append(t.hit_rate)
            self.query_one(RateSparkline).show(list(self._rates))
        n = fmt_count
        self.put(
            "#tails-entries",
            [
                f"{n(t.entries)}/{n(t.max_entries)} entries",
                f"hit rate {t.hit_rate:.0%} ({n(t.hits)}/{n(lookups)})",
            ],
        )
        self.put(
            "#tails-saved",
            [f"saved {n(t.tokens_saved)} tokens", fmt_bytes(t.nbytes), f"evicted {n(t.evictions)}"],
        )


class SnapshotsPanel(Panel):
    TITLE = "Snapshots & checkpoints"

    def compose(self) -> ComposeResult:
        yield Static("", classes="line", id="snapshots-text", markup=False)
        yield Static("", classes="line", id="checkpoints-text", markup=False)

    def show(self, stats: CacheStats) -> None:
        s = stats.snapshots
        self.put("#snapshots-text", [f"snapshots {fmt_count(s.count)}", fmt_bytes(s.nbytes)])
        t = stats.tails
        # held now vs used since start: a cleared checkpoint's hit still counts
        self.put(
            "#checkpoints-text",
            [
                f"checkpoints held {fmt_count(t.checkpoints)}",
                f"used {fmt_count(t.checkpoint_hits)}×",
            ],
        )


LAST_TURN_ROWS = (
    ("prompt", "prompt"),
    ("cached", "cached"),
    ("prefilled", "prefilled"),
    ("ttft", "TTFT"),
    ("prefill_tps", "prefill"),
    ("decode_tps", "decode"),
)


class LastTurnPanel(Panel):
    """The last turn's figures, one aligned row each (label, value), then the cached
    tokens' split by tier and by kind.

    The rows are one ``Static`` rendered in full by :meth:`show` (a ``DataTable`` sized
    its value column on a later idle, so a screen read right after a poll could show a
    value cut to the column's earlier width)."""

    TITLE = "Last turn"
    LABEL_WIDTH = max(len(label) for _key, label in LAST_TURN_ROWS) + 2
    """Cells of the label column (the longest label and two spaces)."""

    def compose(self) -> ComposeResult:
        yield Static("", classes="line", id="last-turn", markup=False)
        # the cached tokens' split: lines of their own, broken between parts (one row is
        # one line: "block 261,888 · tail 64 · checkpoint 128" passed the panel)
        yield Static("", classes="line", id="last-turn-by", markup=False)
        yield Static("", classes="line", id="last-turn-kind", markup=False)

    def on_mount(self) -> None:
        self.put_rows(dict.fromkeys((key for key, _label in LAST_TURN_ROWS), "—"))

    def put_rows(self, values: dict[str, str]) -> None:
        """One row per :data:`LAST_TURN_ROWS` entry, the value after the label column; a
        row wider than the Static puts its value on the next line, indented."""
        static = self.query_one("#last-turn", Static)
        width = static.content_region.width or LINE_WIDTH
        lines: list[str] = []
        for key, label in LAST_TURN_ROWS:
            row = f"{label:<{self.LABEL_WIDTH}}{values[key]}"
            if cell_len(row) <= width:
                lines.append(row)
            else:
                lines.extend((label, f"  {values[key]}"))
        static.update("\n".join(lines))

    def show(self, stats: CacheStats) -> None:
        lt = stats.last_turn
        values = {
            "prompt": f"{fmt_count(lt.prompt_tokens)} tokens",
            "cached": fmt_count(lt.cached_tokens),
            "prefilled": fmt_count(lt.prefill_tokens),
            "ttft": fmt_seconds(lt.ttft_s),
            "prefill_tps": fmt_rate(lt.prefill_tps, lt.prefill_tokens),
            # 0 while the turn still decodes (the rate comes when it ends)
            "decode_tps": f"{lt.generation_tps:.1f} tok/s" if lt.generation_tps else "—",
        }
        if not lt.prompt_tokens:
            values = dict.fromkeys(values, "—")
        self.put_rows(values)
        by = fmt_cached_by(lt.cached_by).split(" · ") if lt.cached_tokens else []
        kind = fmt_cached_kind(lt.cached_kind).split(" · ") if lt.cached_tokens else []
        self.put("#last-turn-by", [f"by tier {by[0]}", *by[1:]] if by else [])
        self.put("#last-turn-kind", [f"by kind {kind[0]}", *kind[1:]] if kind else [])


class EventsPanel(Panel):
    """The engine's recent cache events (hits, evictions, clears, errors), newest last."""

    TITLE = "Events"
    DEFAULT_CSS = """
    EventsPanel RichLog {
        height: 8;
        background: $background;
        overflow-x: hidden;
        scrollbar-size-vertical: 1;
        scrollbar-background: $background;
        scrollbar-background-hover: $background;
        scrollbar-background-active: $background;
    }
    """

    def __init__(self, *, clock: Clock | None = None) -> None:
        super().__init__(clock=clock, id="events-panel")
        self._last_seq = 0
        self._model = ""

    def compose(self) -> ComposeResult:
        log = EventLog(max_lines=500, id="events-log")
        log.can_focus = False
        yield log

    def show(self, stats: CacheStats) -> None:
        newest = stats.events[-1][0] if stats.events else 0
        if (stats.model and stats.model != self._model) or newest < self._last_seq:
            # a model load makes a new cache: its events restart, as its counters do
            self._model, self._last_seq = stats.model, 0
            self.query_one(EventLog).forget()
        fresh = [(seq, text) for seq, text in stats.events if seq > self._last_seq]
        if fresh:
            self._last_seq = fresh[-1][0]
            log = self.query_one(EventLog)
            for seq, text in fresh:
                log.add(Text.assemble((f"{seq:>4} ", "dim"), text))


class EventLog(RichLog):
    """A ``RichLog`` of event lines wrapped to its width whenever it shows.

    ``RichLog`` wraps a line once, at the width the log has when it is written: while the
    panels are folded that is 0, and each event became a column of single characters that
    stayed so once shown. This log keeps the lines (``max_lines`` of them) and wraps them
    all again when it shows or its width changes. ``min_width=1``: a line is never wider
    than the log (the default 78 cropped a ~40-column panel's lines without an ellipsis).
    """

    def __init__(self, *, max_lines: int, id: str | None = None) -> None:
        super().__init__(max_lines=max_lines, wrap=True, markup=False, min_width=1, id=id)
        self._texts: deque[Text] = deque(maxlen=max_lines)
        self._wrapped_at = 0  # the width the lines shown were wrapped at (0: none yet)

    def add(self, text: Text) -> None:
        """Append ``text``: wrapped now if the log shows, else when it next shows."""
        self._texts.append(text)
        if self._width() and self._width() == self._wrapped_at:
            self.write(text)
        else:
            self._wrapped_at = 0  # the lines shown miss this one: wrap all again
            self._wrap()

    def forget(self) -> None:
        """Drop every line (a new cache's events restart)."""
        self._texts.clear()
        self._wrapped_at = 0
        self.clear()

    def _width(self) -> int:
        return self.scrollable_content_region.width if self.display else 0

    def _wrap(self) -> None:
        width = self._width()
        if not width or width == self._wrapped_at:
            return
        self._wrapped_at = width
        self.clear()
        for text in self._texts:
            self.write(text)

    def on_show(self) -> None:
        self._wrap()

    def on_resize(self) -> None:
        self._wrap()


def cache_summary(stats: CacheStats | None, loading: str = "") -> str:
    """The panels in one line, for narrow terminals: hot and SSD use, turn hit rate, the
    last turn's reuse and TTFT, memory pressure. ``loading``: the model being loaded."""
    if loading:
        return f"cache (F2): loading {loading}…"
    if stats is None:
        return "cache (F2): waiting for the engine…"
    if stats.supported is False or not stats.enabled:
        return f"cache (F2): off · {stats.reason or 'caching disabled'}"
    lt = stats.last_turn
    last = (
        f"last turn {fmt_count(lt.cached_tokens)}/{fmt_count(lt.prompt_tokens)} cached, "
        f"TTFT {fmt_seconds(lt.ttft_s)}"
        if lt.prompt_tokens
        else "no turn yet"
    )
    return (
        f"cache (F2): {last} · hot {fmt_bytes(stats.hot.nbytes)}/{stats.hot.entries} · "
        f"SSD {fmt_bytes(stats.ssd.nbytes)}/{stats.ssd.entries} · "
        f"hit {stats.lookups.hit_rate:.0%} of {stats.lookups.lookups} turns · "
        f"memory {stats.memory.level}"
    )


class CacheSummary(Static):
    """One line of cache state, shown when the full panels are not."""

    DEFAULT_CSS = """
    CacheSummary { height: 1; color: $text-muted; padding: 0 1; text-wrap: nowrap;
                   text-overflow: ellipsis; }
    """

    stats: reactive[CacheStats | None] = reactive(None)
    loading: reactive[str] = reactive("")
    """The model being loaded ("" when none): the line says so instead of "off"."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)

    def watch_stats(self) -> None:
        self.update(cache_summary(self.stats, self.loading))

    def watch_loading(self) -> None:
        self.update(cache_summary(self.stats, self.loading))


class CachePanels(VerticalScroll):
    """Every panel, fed by :attr:`stats`."""

    DEFAULT_CSS = """
    CachePanels { width: 46; padding: 0 1 0 0; scrollbar-size-vertical: 1; }
    CachePanels > #cache-model { height: 1; color: $text-muted; padding: 0 1; }
    """

    stats: reactive[CacheStats | None] = reactive(None, init=False)
    """The newest snapshot; ``None`` until the first poll."""
    loading: reactive[str] = reactive("", init=False)
    """The model being loaded ("" when none): the panels say so instead of "caching off"
    (the engine has no cache while it loads)."""

    def __init__(self, *, clock: Clock | None = None, id: str | None = None) -> None:
        super().__init__(id=id)
        self._clock = clock
        self.can_focus = False  # Tab cycles list, transcript and input

    def compose(self) -> ComposeResult:
        from tierchat.tui.widgets.ranks_panel import RanksPanel  # builds on Panel (here)

        yield Static("cache: waiting for the engine…", id="cache-model", markup=False)
        yield RanksPanel(clock=self._clock, id="ranks-panel")  # several ranks only
        yield MemoryPanel(clock=self._clock, id="memory-panel")
        yield HitsPanel(clock=self._clock, id="hits-panel")
        yield TierPanel("hot", "Hot tier (RAM)", clock=self._clock)
        yield TierPanel("ssd", "SSD tier", clock=self._clock)
        yield TailsPanel(clock=self._clock)
        yield SnapshotsPanel(clock=self._clock, id="snapshots-panel")
        yield LastTurnPanel(clock=self._clock, id="last-turn-panel")
        yield EventsPanel(clock=self._clock)

    def watch_stats(self) -> None:
        self._show()

    def watch_loading(self) -> None:
        self._show()

    def _show(self) -> None:
        stats, loading = self.stats, self.loading
        if stats is None:
            return
        if loading:
            header = f"loading {loading}… · cache on when it is ready"
        elif not stats.model:
            header = "no model loaded · F4 picks one"
        else:
            state = {None: "pending", True: "on", False: "off"}[stats.supported]
            if not stats.enabled and stats.supported is not False:
                state = "disabled"
            header = f"{stats.model} · cache {state} · block {stats.block_size} tokens"
        try:
            line = self.query_one("#cache-model", Static)
        except NoMatches:  # children gone: the app is closing under a stats poll
            return
        line.update(header)
        for panel in self.query(Panel):
            if isinstance(panel, TierPanel):
                panel.show(stats, loading)
            else:
                panel.show(stats)
