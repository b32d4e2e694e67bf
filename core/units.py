"""How sizes, counts and durations read, everywhere tierchat prints one.

One home for these forms, used by the core's messages (``core.memory``), the settings
(``config``), the CLI and the TUI alike, so a size reads the same in a refusal, in
``tierchat cache stats`` and in the cache panels. Sizes are binary (1 KiB = 1024 B), the
units ``config.settings.parse_size`` reads back: a size printed here can be typed into
``--memory-limit`` or ``--hot-bytes`` (``"2.0 GiB"``). No MLX, no Textual.
"""

from __future__ import annotations

_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB")


def fmt_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it below 1024, one decimal from KiB up.

    ``1536`` -> ``"1.5 KiB"``, ``900`` -> ``"900 B"``, ``16 << 30`` -> ``"16.0 GiB"``;
    TiB is the largest unit. A negative size keeps its sign (``"-2.0 KiB"``, a change).
    """
    sign = "-" if nbytes < 0 else ""
    value = abs(float(nbytes))
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in _BINARY_UNITS:
        value /= 1024
        if round(value, 1) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")


def fmt_bytes_exact(nbytes: int) -> str:
    """:func:`fmt_bytes`, but every byte below 1 MiB (``"65,536 B"``).

    For a limit the user set: a small one shown rounded ("64.0 KiB") would hide what was
    typed.
    """
    return f"{int(nbytes):,} B" if abs(nbytes) < 1 << 20 else fmt_bytes(nbytes)


def fmt_count(n: int) -> str:
    """``12345`` -> ``"12,345"``."""
    return f"{n:,}"


def fmt_seconds(seconds: float) -> str:
    """A duration such as a TTFT: whole milliseconds below one second, else two decimals.

    ``0.0234`` -> ``"23 ms"``, ``1.5`` -> ``"1.50 s"``.
    """
    if round(seconds * 1000) < 1000:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s"
