"""The server's traffic: a queue line and one table row per request.

:class:`RequestLogView` holds one reactive, ``snapshot`` (a
:class:`~tierchat.core.serve.log.LogSnapshot`); its watcher adds rows for new requests and
updates the cells of the ones that changed (``DataTable.update_cell``). Polling is the
screen's job.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import DataTable, Static
from tierchat.core.serve.log import LogSnapshot, RequestRecord
from tierchat.core.units import fmt_count, fmt_seconds
from tierchat.tui.format import fmt_cached_by, fmt_cached_kind

COLUMNS: tuple[tuple[str, str], ...] = (
    ("seq", "#"),
    ("time", "time"),
    ("client", "client"),
    ("api", "api"),
    ("status", "status"),
    ("prompt", "prompt"),
    ("cached", "cached"),
    ("source", "by tier · kind"),
    ("prefill", "prefilled"),
    ("ttft", "TTFT"),
    ("wait", "queued"),
    ("tps", "tok/s"),
)

STATUS_LABELS = {
    "waiting": "queued",
    "running": "running",
    "stopping": "stopping…",
    "done": "done",
    "failed": "failed",
    "cancelled": "cancelled",
}


def record_cells(record: RequestRecord, clock_time=time.localtime) -> tuple[str, ...]:
    """The row of one request, in :data:`COLUMNS` order."""
    m = record.metrics
    finished = record.status in ("done", "cancelled") and m.prompt_tokens > 0
    source = ""
    if finished and m.cached_tokens:
        source = f"{fmt_cached_by(m.cached_by)} | {fmt_cached_kind(m.cached_kind)}"
    elif record.status == "failed":
        source = record.error[:60]
    return (
        str(record.seq),
        time.strftime("%H:%M:%S", clock_time(record.submitted_at)),
        record.client,
        record.endpoint,
        record.phase or STATUS_LABELS.get(record.status, record.status),
        fmt_count(m.prompt_tokens) if m.prompt_tokens else "",
        fmt_count(m.cached_tokens) if finished else "",
        source,
        fmt_count(m.prefill_tokens) if finished else "",
        fmt_seconds(m.ttft_s) if finished else "",
        fmt_seconds(record.wait_s) if finished else "",
        f"{m.generation_tps:.1f}" if finished else "",
    )


def queue_line(snapshot: LogSnapshot | None) -> str:
    if snapshot is None:
        return "server: starting…"
    failed = f" ({snapshot.failed} failed)" if snapshot.failed else ""
    where = f"{snapshot.url} · " if snapshot.url else ""
    return (
        f"{where}queue: {snapshot.waiting} waiting · {snapshot.running} running · "
        f"{fmt_count(snapshot.total)} requests{failed}"
    )


class RequestLogView(Vertical):
    """The queue line and the request table, fed by :attr:`snapshot`."""

    DEFAULT_CSS = """
    RequestLogView { height: 1fr; border: round $primary 40%; border-title-color: $text; }
    RequestLogView > #queue-line { height: 1; padding: 0 1; color: $text-muted; }
    RequestLogView > DataTable { height: 1fr; }
    """

    snapshot: reactive[LogSnapshot | None] = reactive(None, init=False)
    """The newest log snapshot; ``None`` until the first poll."""

    def __init__(self, *, clock_time=time.localtime, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Requests"
        self._clock_time = clock_time
        self._shown: dict[int, RequestRecord] = {}
        self._version = -1

    def compose(self) -> ComposeResult:
        yield Static(queue_line(None), id="queue-line", markup=False)
        table: DataTable = DataTable(cursor_type="row", zebra_stripes=True)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        yield table

    @property
    def table(self) -> DataTable:
        return self.query_one(DataTable)

    def watch_snapshot(self, snapshot: LogSnapshot | None) -> None:
        self.query_one("#queue-line", Static).update(queue_line(snapshot))
        if snapshot is None or snapshot.version == self._version:
            return
        self._version = snapshot.version
        table = self.table
        following = table.row_count == 0 or table.cursor_row >= table.row_count - 1
        keep = {r.seq for r in snapshot.records}
        for seq in [s for s in self._shown if s not in keep]:
            table.remove_row(str(seq))
            del self._shown[seq]
        added = False
        for record in snapshot.records:
            old = self._shown.get(record.seq)
            if old is record or old == record:
                continue
            cells = record_cells(record, self._clock_time)
            if old is None:
                table.add_row(*cells, key=str(record.seq))
                added = True
            else:
                before = record_cells(old, self._clock_time)
                for (key, _), value, was in zip(COLUMNS, cells, before, strict=True):
                    if value != was:
                        table.update_cell(str(record.seq), key, value)
            self._shown[record.seq] = record
        if added and following:
            table.move_cursor(row=table.row_count - 1)
