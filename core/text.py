"""Text from a model or a file made safe to print on a terminal.

A reply may contain terminal control sequences (``ESC ] 0 ; title BEL`` retitles the
window, ``ESC [ 31 m`` recolours it, C1 ``CSI`` 0x9B does the same in one byte). Printed
raw, the model drives the user's terminal. :func:`printable` removes every C0 control
character but newline and tab, DEL, and every C1 control character (ECMA-48), which
leaves each sequence's introducer out and its remainder as harmless visible text.
:func:`log_safe` writes the same characters (newline and tab too) as ``\\xNN`` instead,
for one log line; :func:`one_line` makes a short quote of client text.
"""

from __future__ import annotations

_CONTROLS = (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0))  # C0, DEL, C1
_CONTROL = {c: None for c in _CONTROLS if c not in (ord("\n"), ord("\t"))}
_ESCAPES = {c: f"\\x{c:02x}" for c in _CONTROLS}


def printable(text: str) -> str:
    """``text`` without C0/C1 control characters (``\\n`` and ``\\t`` kept)."""
    return text.translate(_CONTROL)


def one_line(value: str, limit: int = 80) -> str:
    """The first ``limit`` characters of ``value`` for a one-line message (a header a
    client sent, quoted in an error): every unprintable character, newline and tab
    included, becomes ``?``."""
    return "".join(c if c.isprintable() else "?" for c in value[:limit])


def log_safe(text: str) -> str:
    """``text`` with every C0/C1 control character (newline, tab and ESC included) and DEL
    written as ``\\xNN``: one line that cannot forge another log line or drive the
    terminal (docs/DESIGN.md §15). Client-given text goes through it before any log."""
    return text.translate(_ESCAPES)
