"""The one home of size, count and duration formats (core/units.py) and its users.

A size printed by the core (a refused prompt), the CLI (``cache stats``, ``chat``) and the
TUI (the panels) reads the same, and ``parse_size`` reads it back.
"""

from __future__ import annotations

import pytest
from tierchat.config.settings import parse_size
from tierchat.core.units import fmt_bytes, fmt_bytes_exact, fmt_count, fmt_seconds


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (512 << 20, "512.0 MiB"),
        (16 << 30, "16.0 GiB"),
        (2_100_000_000, "2.0 GiB"),
        ((1 << 20) - 1, "1.0 MiB"),  # 1023.999 KiB rounds up: the next unit, never "1024.0 KiB"
        (3 << 40, "3.0 TiB"),
        (5000 << 40, "5000.0 TiB"),  # TiB is the largest unit
        (-2048, "-2.0 KiB"),
        (-5, "-5 B"),
    ],
)
def test_fmt_bytes(nbytes, text):
    assert fmt_bytes(nbytes) == text


@pytest.mark.parametrize("nbytes", [0, 900, 1536, 6 * 10**9, 16 << 30, 123_456_789_012])
def test_a_printed_size_reads_back_within_its_rounding(nbytes):
    text = fmt_bytes(nbytes)
    back = parse_size(text)
    unit = 1 << (10 * ("B", "KiB", "MiB", "GiB", "TiB").index(text.split()[1]))
    assert abs(back - nbytes) <= 0.05 * unit + 1, (nbytes, text, back)


def test_fmt_bytes_exact_below_one_mib():
    assert fmt_bytes_exact(65_536) == "65,536 B"
    assert fmt_bytes_exact((1 << 20) - 1) == "1,048,575 B"
    assert fmt_bytes_exact(1 << 20) == "1.0 MiB"


def test_fmt_count_and_seconds():
    assert fmt_count(12345) == "12,345"
    assert fmt_seconds(0.0234) == "23 ms"
    assert fmt_seconds(0.9996) == "1.00 s"  # not "1000 ms"
    assert fmt_seconds(1.5) == "1.50 s"


def test_every_user_formats_sizes_through_core_units():
    """The other byte formatters are gone: memory, settings and tui.format hold none."""
    from tierchat import config
    from tierchat.core.memory import prefill as memory
    from tierchat.tui import format as tui_format

    assert not hasattr(memory, "format_bytes")
    assert not hasattr(config, "format_size")
    assert getattr(tui_format, "fmt_bytes", fmt_bytes) is fmt_bytes  # imported, not its own
    assert memory.fmt_bytes is fmt_bytes


def test_refusal_and_cli_print_sizes_in_the_same_form():
    from types import SimpleNamespace

    from tierchat.cli.chat import stats_lines
    from tierchat.core.api import LookupStats
    from tierchat.core.memory.prefill import PrefillRefused

    err = PrefillRefused(estimate_bytes=3 << 30, limit_bytes=2 << 30, chunk_tokens=512)
    assert "3.0 GiB" in str(err) and "2.0 GiB" in str(err)
    tier = dict(entries=1, nbytes=3 << 30, max_bytes=4 << 30, hits=0, misses=0)
    stats = SimpleNamespace(
        enabled=True,
        hot=SimpleNamespace(**tier, evictions=0),
        ssd=SimpleNamespace(**tier, enabled=True, reason=""),
        tails=SimpleNamespace(entries=0, hits=0, checkpoint_hits=0),
        lookups=LookupStats(),
    )
    assert "3.0 GiB of 4.0 GiB" in stats_lines(stats)
