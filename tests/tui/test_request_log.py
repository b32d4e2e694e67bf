"""The serve console's request rows use the shared formats: tiers and kinds as the cache
panels write them (``tui.format``), counts and durations from ``core.units``."""

from __future__ import annotations

import time

from tierchat.core.api import TurnMetrics
from tierchat.core.serve.log import RequestRecord
from tierchat.tui.widgets.request_log import COLUMNS, record_cells


def cells(wait_s: float = 0.0, **metrics) -> dict[str, str]:
    base = dict(seq=7, client="127.0.0.1", endpoint="chat", submitted_at=0.0, status="done")
    record = RequestRecord(**base, wait_s=wait_s, metrics=TurnMetrics(**metrics))
    row = record_cells(record, clock_time=time.gmtime)
    return dict(zip((key for key, _ in COLUMNS), row, strict=True))


def test_a_finished_request_reads_like_the_panels():
    row = cells(
        prompt_tokens=2600,
        cached_tokens=2552,
        cached_by={"hot": 2512, "ssd": 40},
        cached_kind={"resident": 0, "block": 2512, "tail": 40, "checkpoint": 0},
        prefill_tokens=48,
        ttft_s=0.0234,
        wait_s=12.5,
    )
    assert row["time"] == "00:00:00"
    assert (row["prompt"], row["cached"], row["prefill"]) == ("2,600", "2,552", "48")
    assert row["source"] == "hot 2,512 · SSD 40 | block 2,512 · tail 40"
    assert (row["ttft"], row["wait"]) == ("23 ms", "12.50 s")


def test_kinds_keep_the_panels_order_whatever_the_dict_order():
    row = cells(
        prompt_tokens=100,
        cached_tokens=99,
        cached_by={"hot": 99, "ssd": 0},
        cached_kind={"checkpoint": 3, "block": 96},
    )
    assert row["source"] == "hot 99 | block 96 · checkpoint 3"
