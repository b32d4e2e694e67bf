"""``tierchat cache stats`` on a running app's figures (its status file; no model is
loaded): hits counted as the panels count them, floats rounded as the panels show them."""

from __future__ import annotations

import json

import pytest
from tierchat.cli.main import main
from tierchat.core.api import CacheStats, LookupStats, ResidentStats, TurnMetrics
from tierchat.core.live_status import StatusWriter

pytestmark = pytest.mark.usefixtures("isolated_settings")

# what the engine reports after a cold turn and six turns served by the resident cache
SIX_RESIDENT_HITS = CacheStats(
    model="demo",
    block_size=16,
    supported=True,
    resident=ResidentStats(tokens=393, nbytes=4 << 20, hits=6),
    lookups=LookupStats(resident=6, cold=1),
    last_turn=TurnMetrics(
        prompt_tokens=393,
        cached_tokens=380,
        prefill_tokens=13,
        ttft_s=0.0234567891,
        prefill_tps=25775.312345,
        generation_tokens=40,
        generation_tps=41.98765,
        restore_s=1.23456,
    ),
)


def stats_table(capsys, cache_dir) -> dict[str, str]:
    assert main(["cache", "stats", "--cache-dir", str(cache_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("live figures from the running tierchat TUI")
    return {line.split()[0]: " ".join(line.split()[1:]) for line in out[1:] if line.strip()}


def test_hits_of_every_kind_are_counted_as_the_hits_panel_counts_them(tmp_path, capsys):
    StatusWriter(tmp_path).write("demo", SIX_RESIDENT_HITS)
    rows = stats_table(capsys, tmp_path)
    # named for what they count: hot entries used (the Hot panel's "entries used"), not
    # turns served from RAM (six here, all from the resident cache)
    assert "hot.hits" not in rows and rows["hot.entries_used"] == "0"
    assert "ssd.hits" not in rows and rows["ssd.entries_read"] == "0"
    assert rows["resident.hits"] == "6"
    assert (rows["lookups.hits"], rows["lookups.lookups"]) == ("6", "7")
    assert rows["lookups.hit_rate"] == "86%"  # the Hits panel: "hit rate 86% (6/7 turns)"
    names = list(rows)
    assert names.index("lookups.tail") < names.index("lookups.hits") < names.index("memory.active")

    assert main(["cache", "stats", "--json", "--cache-dir", str(tmp_path)]) == 0
    lookups = json.loads(capsys.readouterr().out)["lookups"]
    assert (lookups["hits"], lookups["lookups"], lookups["resident"]) == (6, 7, 6)
    assert lookups["hit_rate"] == pytest.approx(6 / 7)  # the JSON keeps raw numbers


def test_floats_are_rounded(tmp_path, capsys):
    StatusWriter(tmp_path).write("demo", SIX_RESIDENT_HITS)
    rows = stats_table(capsys, tmp_path)
    assert rows["last_turn.ttft_s"] == "23 ms"
    assert rows["last_turn.restore_s"] == "1.23 s"
    assert rows["last_turn.prefill_tps"] == "25775.3 tok/s"
    assert rows["last_turn.generation_tps"] == "42.0 tok/s"
    for name, value in rows.items():  # no raw float anywhere
        assert not any(len(part.partition(".")[2]) > 2 for part in value.split()), (name, value)
