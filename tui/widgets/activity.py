"""A one-line progress strip above the input: prefill progress, a verify against cold or
model loading."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.clock import Clock
from textual.containers import Horizontal
from textual.widgets import ProgressBar, Static
from tierchat.core.units import fmt_count


class ActivityBar(Horizontal):
    """Hidden unless a long prefill, a verify or a model load is under way."""

    DEFAULT_CSS = """
    ActivityBar { height: 1; padding: 0 1; display: none; }
    ActivityBar.-active { display: block; }
    ActivityBar > #activity-label { width: auto; max-width: 60%; color: $text-muted; }
    ActivityBar > ProgressBar { width: 1fr; padding-left: 1; }
    ActivityBar > ProgressBar > Bar { width: 1fr; }
    """

    def __init__(self, *, clock: Clock | None = None, id: str | None = None) -> None:
        super().__init__(id=id)
        self._clock = clock

    def compose(self) -> ComposeResult:
        yield Static("", id="activity-label", markup=False)
        yield ProgressBar(total=1, show_eta=False, clock=self._clock, id="activity-bar")

    @property
    def label(self) -> str:
        return str(self.query_one("#activity-label", Static).content)

    def _show(self, label: str, done: int, total: int) -> None:
        self.add_class("-active")
        self.query_one("#activity-label", Static).update(label)
        self.query_one(ProgressBar).update(total=max(total, 1), progress=min(done, max(total, 1)))

    def show_prefill(self, done: int, total: int, tps: float) -> None:
        """Prefill progress after each chunk; while the first chunk runs (``done`` 0, up
        to ``prefill_chunk`` tokens in one step) the bar is indeterminate, not stuck at 0%."""
        rate = f" · {tps:.0f} tok/s" if tps else ""
        label = f"prefill {fmt_count(done)}/{fmt_count(total)} tokens{rate}"
        if done <= 0:
            self.add_class("-active")
            self.query_one("#activity-label", Static).update(f"{label} · first chunk running")
            self.query_one(ProgressBar).update(total=None)
            return
        self._show(label, done, total)

    def show_verify(self, done: int, total: int) -> None:
        """A verify's progress (core/chat/verify.py): ``done`` of ``total`` token
        positions over its three runs, and which run: the cached one, then two cold."""
        run = min(2, done * 3 // max(total, 1))
        what = ("through the cache", "cold 1/2", "cold 2/2")[run]
        label = f"verify {fmt_count(done)}/{fmt_count(total)} tokens · {what} · Esc stops"
        self._show(label, done, total)

    def show_stopping(self, what: str = "") -> None:
        """A stop was asked for: it takes effect at the engine's next step (an
        indeterminate bar until the reply's last event); ``what``: " verify" for a
        verify, "" for a reply."""
        self.add_class("-active")
        self.query_one("#activity-label", Static).update(f"stopping{what}…")
        self.query_one(ProgressBar).update(total=None)

    def show_loading(self, model: str, done: int, total: int, note: str) -> None:
        """Model load progress; before the first step is done (a long GGUF assembly
        reports nothing for a while) the bar is indeterminate rather than stuck at 0%."""
        extra = f" · {note}" if note else ""
        if done <= 0:
            self.add_class("-active")
            self.query_one("#activity-label", Static).update(f"loading {model}{extra}")
            self.query_one(ProgressBar).update(total=None)
            return
        self._show(f"loading {model}{extra}", done, total)

    def hide(self) -> None:
        if self.has_class("-active"):
            self.remove_class("-active")
