"""A message's tool fields as chat templates read them, and where the special-token
spellings inside them land in a render (docs/DESIGN.md §4).

Besides ``role`` and ``content``, a prompt message may carry the OpenAI chat fields
``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments"}}]``, the
arguments a string of JSON), ``tool_call_id`` and ``name`` (on ``role: "tool"`` results) and
``reasoning_content`` (an assistant's reasoning). Hugging Face templates read
``message.tool_calls[i].function.arguments`` as a mapping (Qwen2.5 and Hermes render it with
``| tojson``), so a JSON-object string is parsed before rendering, as mlx-lm's
``server.py`` (``process_message_content``) does; a string that is not a JSON object stays a
string.

Tool arguments and reasoning are rendered as markup, outside the message's content span.
To tokenize a special token's spelling inside them (``<|im_end|>`` in a shell command) as
text, each spelling is replaced by a marker in one more render of the message; where the
markers land, after the lengths they stand for, gives the spellings' places in the real
render (:func:`marked_ranges`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

TOOL_FIELDS: tuple[str, ...] = ("tool_calls", "tool_call_id", "name", "reasoning_content")
"""The message fields passed to the template besides ``role`` and ``content``."""

_MARKER = "TIERCHAT7MARK{}X"
_MARKER_RE = re.compile(r"TIERCHAT7MARK(\d+)X")


def message_fields(m: Any) -> dict[str, Any]:
    """The tool fields of a message (a mapping or an object with attributes) that are set,
    as given (not None; ``tool_calls`` also not empty)."""
    get = m.get if isinstance(m, Mapping) else lambda k: getattr(m, k, None)
    out = {}
    for k in TOOL_FIELDS:
        v = get(k)
        if v is not None and not (k == "tool_calls" and not v):
            out[k] = v
    return out


def fields_key(fields: Mapping[str, Any]) -> bytes:
    """Bytes that differ whenever ``fields`` differ (canonical JSON; b"" when none)."""
    if not fields:
        return b""
    return json.dumps(fields, sort_keys=True, ensure_ascii=True, default=str).encode()


def _parsed_call(call: Any) -> Any:
    """A tool call with its ``arguments`` (under ``function`` or at the top) parsed into a
    dict when they are a string of a JSON object."""
    if not isinstance(call, Mapping):
        return call
    out = dict(call)
    fn = out.get("function")
    if isinstance(fn, Mapping):
        out["function"] = _parsed_call(fn)
        return out
    args = out.get("arguments")
    if isinstance(args, str) and args:
        try:
            value = json.loads(args)
        except ValueError:
            value = None
        if isinstance(value, dict):
            out["arguments"] = value
    return out


def template_message(role: str, content: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The message dict a chat template gets: ``role``, ``content`` and the set tool fields,
    tool-call arguments parsed (module docstring)."""
    msg: dict[str, Any] = {"role": role, "content": content}
    for k, v in fields.items():
        msg[k] = [_parsed_call(c) for c in v] if k == "tool_calls" else v
    return msg


def _strings(x: Any) -> Iterator[str]:
    if isinstance(x, str):
        yield x
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _strings(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _strings(v)


def field_strings(fields: Mapping[str, Any]) -> list[str]:
    """Every string inside ``fields`` (names, ids, argument strings, reasoning)."""
    return list(_strings(dict(fields)))


def spells_special(fields: Mapping[str, Any], specials: Sequence[str]) -> bool:
    """Whether any string in ``fields`` contains a special token's spelling."""
    return bool(specials) and any(t in s for s in _strings(dict(fields)) for t in specials)


def mark_specials(
    fields: Mapping[str, Any], specials: Sequence[str]
) -> tuple[dict[str, Any], list[str]]:
    """``fields`` with every special-token spelling in its strings replaced by a numbered
    marker, and the spellings by marker number. Longest spellings match first."""
    pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
    spellings: list[str] = []

    def sub(match: re.Match) -> str:
        spellings.append(match.group(0))
        return _MARKER.format(len(spellings) - 1)

    def walk(x: Any) -> Any:
        if isinstance(x, str):
            return pattern.sub(sub, x)
        if isinstance(x, Mapping):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        return x

    return {k: walk(v) for k, v in fields.items()}, spellings


def marked_ranges(rendered: str, probe: str, spellings: Sequence[str]) -> list[tuple[int, int]]:
    """``[start, end)`` in ``rendered`` of each spelling whose marker ``probe`` (the same
    render with :func:`mark_specials`' fields) holds: a marker at ``p`` stands at ``p`` plus
    the length the earlier markers gained back. A place whose text is not the spelling (the
    template escaped or changed it: then it is no special token anyway) is left out."""
    out: list[tuple[int, int]] = []
    delta = 0
    for match in _MARKER_RE.finditer(probe):
        k = int(match.group(1))
        if k >= len(spellings):
            continue
        spelling = spellings[k]
        at = match.start() + delta
        delta += len(spelling) - len(match.group(0))
        if rendered[at : at + len(spelling)] == spelling:
            out.append((at, at + len(spelling)))
    return out


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders tools: its source mentions ``tools``
    (a named-template dict counts when any of its templates does). For mlx-lm's
    ``TokenizerWrapper`` the wrapped tokenizer's template is read; a wrapper with its own
    renderer and no template text answers ``has_tool_calling``."""
    source = getattr(tokenizer, "chat_template", None)
    if source is None:
        inner = getattr(tokenizer, "_tokenizer", None)
        source = getattr(inner, "chat_template", None) if inner is not None else None
    if isinstance(source, Mapping):
        source = "\n".join(str(v) for v in source.values())
    if isinstance(source, str):
        return "tools" in source
    return bool(getattr(tokenizer, "has_tool_calling", False))
