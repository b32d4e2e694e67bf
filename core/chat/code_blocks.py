"""The fenced code blocks of a Markdown message (CommonMark 0.31 §4.5), so one block can
be copied without the prose around it.

A fence is three or more backticks or tildes, indented by at most three spaces; the block
ends at a closing fence of the same character at least as long (nothing else on that
line), or at the end of the message when it is never closed (CommonMark: a cut-off reply
still yields its last block). The info string's first word is the language. Content lines
lose up to the opening fence's indentation, as CommonMark says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_OPEN = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")


@dataclass(frozen=True)
class CodeBlock:
    """One fenced block: ``language`` ("" when none given), ``code`` (its lines, joined
    with newlines, no trailing newline), ``line`` (0-based line of the opening fence) and
    ``closed`` (False when the message ends inside it)."""

    language: str
    code: str
    line: int
    closed: bool = True


def fenced_blocks(text: str) -> list[CodeBlock]:
    """Every fenced code block of ``text``, in order."""
    lines = text.splitlines()
    blocks: list[CodeBlock] = []
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if m is None or (m.group(2)[0] == "`" and "`" in m.group(3)):
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
        close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            line = lines[j]
            strip = len(line) - len(line.lstrip(" "))
            body.append(line[min(indent, strip) :])
            j += 1
        closed = j < len(lines)
        language = info.split()[0] if info else ""
        blocks.append(CodeBlock(language, "\n".join(body), i, closed))
        i = j + 1
    return blocks
