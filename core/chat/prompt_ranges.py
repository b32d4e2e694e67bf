"""The ranges of a prompt's text tokenized as text, and the whole-text tokenization that
checks the piece-by-piece one (core/chat/prompts.py, docs/DESIGN.md §4). Offsets are
characters of the rendered prompt ``full``."""

from __future__ import annotations

import bisect
import json
from typing import Any

from ..api import Tokenizer
from .token_text import encode_markup, encode_text
from .tool_fields import field_strings


def decodes_byte_by_byte(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` decodes through a Hugging Face ``ByteLevel`` decoder (each id
    a run of bytes: the text of concatenated ids is the concatenation of their texts
    wherever each run is whole UTF-8). False when it cannot tell."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


def content_ranges(
    msgs: list[Any], spans: list[Any], full: str, specials: tuple[str, ...]
) -> dict[int, int]:
    """``start -> end`` (characters of ``full``) of every range to tokenize as text: each
    content span, each special spelling in a message's tool fields, and, for a message
    without a span, its content and tool-field strings when they spell a special token
    (found by search after the previous message's end; where the template changed them
    beyond a strip or JSON quoting, they are not found and stay with the markup)."""
    out: dict[int, int] = {}
    pos = 0
    for m, span in zip(msgs, spans, strict=True):
        if span is not None:
            if span.content_end is not None and span.content_end > span.content_start:
                out[span.content_start] = span.content_end
            out.update(span.text)
            pos = max(pos, span.end)
            continue
        start = pos
        found = find_text(m.content, full, pos, specials, (m.content, m.content.strip()), [])
        if found is not None:
            out[found[0]] = found[1]
            pos = found[1]
        taken = [found] if found is not None else []
        fields = m.template()  # arguments parsed, as the template rendered them
        for s in field_strings({k: v for k, v in fields.items() if k in m.fields}):
            quoted = json.dumps(s, ensure_ascii=False)
            found = find_text(s, full, start, specials, (quoted, quoted[1:-1], s), taken)
            if found is None:  # (reasoning may come before the content: from ``start``)
                continue
            taken.append(found)
            for t in specials:  # only the spellings: the rest stays with its markup
                at = full.find(t, *found)
                while at >= 0:
                    out[at] = at + len(t)
                    at = full.find(t, at + len(t), found[1])
            pos = max(pos, found[1])
    return out


def find_text(
    text: str,
    full: str,
    pos: int,
    specials: tuple[str, ...],
    forms: tuple[str, ...],
    taken: list[tuple[int, int]],
) -> tuple[int, int] | None:
    """Where the first of ``forms`` lies in ``full`` from ``pos``, clear of the ranges
    ``taken``, when ``text`` spells a special token (None otherwise, or when not found)."""
    if not any(t in text for t in specials):
        return None
    for form in forms:
        at = full.find(form, pos) if form else -1
        while at >= 0:
            if not any(a < at + len(form) and at < b for a, b in taken):
                return at, at + len(form)
            at = full.find(form, at + 1)
    return None


def inside(starts: list[int], content: dict[int, int], a: int, b: int) -> bool:
    """Whether the piece ``[a, b)`` lies inside one content range."""
    i = bisect.bisect_right(starts, a) - 1
    return i >= 0 and b <= content[starts[i]]


def encode_whole(builder, full: str, content: dict[int, int]) -> list[int]:
    """The whole-text tokenization of ``full`` (the canonical form and the fallback): in
    one piece, but cut around each content range that spells a special token, which is
    tokenized as text."""
    risky = sorted(
        (a, b) for a, b in content.items() if any(t in full[a:b] for t in builder.specials)
    )
    if not risky:
        return encode_markup(builder.tokenizer, full)
    out: list[int] = []
    pos = 0
    for a, b in risky:
        out += encode_markup(builder.tokenizer, full[pos:a]) + encode_text(
            builder.tokenizer, full[a:b]
        )
        pos = b
    return out + encode_markup(builder.tokenizer, full[pos:])


def fallback_boundaries(tokenizer, msgs, spans, full, whole) -> tuple[tuple[int, str], ...]:
    out: list[tuple[int, str]] = []
    for m, span in zip(msgs, spans, strict=True):
        if span is None:
            continue
        head = encode_markup(tokenizer, full[: span.end])
        if whole[: len(head)] == head and (not out or len(head) > out[-1][0]):
            out.append((len(head), m.role))
    return tuple(out)
