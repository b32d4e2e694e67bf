"""Prompt token ids for a conversation path: chat template, message boundaries, splicing.

docs/DESIGN.md §4. The cache key is the prompt's token-id sequence, so turn k+1's prompt must
begin with exactly turn k's prompt + the ids the model generated. Re-tokenizing a reply's
text often gives other ids than were generated (BPE prefers merges the sampler did not
take), so the generated ids of each assistant message are spliced back in where the
templated text matches them.

How (works with any chat template that renders messages in order):

1. Render the full prompt text ``T`` (with the generation prompt). For each message ``i``
   render ``messages[:i+1]`` (``R_i``) and the same list with message ``i``'s content
   replaced by a sentinel (``S_i = pre + SENTINEL + post``). When ``R_i`` is a prefix of
   ``T`` and ``R_i == pre + X + post``, ``X`` is the message's rendered content, at
   ``[len(pre), len(R_i) - len(post))``, and the message ends at ``len(R_i)`` (after its
   closing tokens, e.g. ``<|im_end|>\\n``).
2. Cut ``T`` at every content start/end and message end, and tokenize piece by piece with
   ``add_special_tokens=False`` (the template text already holds BOS/special tokens).
   Template markup is tokenized with its special tokens; a message's content as text
   (:func:`~.token_text.encode_text`): a special token's spelling inside content (``<|im_end|>``)
   becomes ordinary tokens, so no message can open or close a role. A message without a
   content span whose content spells a special token is found in ``T`` by search and cut
   out as text the same way.
   Tool-call arguments, reasoning and the ``tools`` list are rendered as markup; the
   special spellings inside them are placed by one more render with markers in their
   place (core/chat/tool_fields.py) and tokenized as text too (found by search when the
   message has no span).
   Because the cuts of turn k are also cuts of turn k+1 and each piece is tokenized on its
   own, turn k's ids are a prefix of turn k+1's.
3. For an assistant message with ``token_ids``: when ``decode(ids)`` (EOS included) equals
   the text at the content start, those ids replace the piece; else the longest prefix of
   the ids whose decoding is a prefix of the content is spliced and the rest re-tokenized
   (:func:`~.token_text.splice_len`).
   A reply the template renders without content (tool calls only) is spliced from where
   the generation prompt ends, when its ids decode to the text there.

Messages may carry tool fields (``tool_calls``, ``tool_call_id``, ``name``,
``reasoning_content``; role ``"tool"``) and a build may pass ``tools`` and
``enable_thinking`` to the template: all of them are part of every render's cache key.

Where this cannot hold (documented, fail closed -- the prompt is still correct, the cache
just misses from that point):

- Piece-by-piece tokenization equals whole-text tokenization when every cut falls on a
  pre-tokenizer split. Cuts next to special tokens always do. Byte-level BPE (Qwen2,
  Llama 3) can differ when a message's content *starts* with whitespace or a newline
  after the header's newline (``"\\n" + "\\nHi"`` vs ``"\\n\\nHi"``); the pieces are then a
  valid but non-canonical tokenization, consistent from turn to turn.
  ``Prompt.canonical`` says whether the ids equal the whole-text tokenization.
- If the pieces do not decode to the same text as the whole (a tokenizer that prepends a
  space to every piece, SentencePiece ``add_dummy_prefix``), the whole text is tokenized
  instead, nothing is spliced and ``Prompt.fallback`` says why.
- Tool calls: the template re-renders the arguments as JSON (key order, spacing,
  escapes), which often is not the text the model generated; the reply's ids are then
  spliced only as far as they match (its content), and the tool-call markup is
  tokenized from the text, so the cache misses from there.
- Templates that render a message differently when it is not last (Qwen3 drops
  ``<think>`` from earlier replies), trim content (Gemma ``| trim`` vs a reply ending in a
  newline) or fold one message into another (Gemma folds the system prompt into the first
  user turn): that message gets no span; its text is tokenized normally and, where its end
  is not a prefix of the full render, it gets no boundary.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..api import Tokenizer
from . import prompt_ranges as ranges
from .token_text import decode_ids, encode_markup, encode_text, special_spellings, splice_len
from .tool_fields import (
    fields_key,
    mark_specials,
    marked_ranges,
    message_fields,
    spells_special,
    template_message,
    template_supports_tools,
)

__all__ = [
    "Prompt",
    "PromptBuilder",
    "build_prompt",
    "decode_ids",
    "encode_text",
    "special_spellings",
    "template_supports_tools",
]

SENTINEL = "TIERCHAT7SENTINEL3CONTENT"


@dataclass(frozen=True)
class Prompt:
    """Token ids of one prompt and where each message ends.

    ``boundaries``: ``(end_offset, role)`` per message whose end is known, the token
    offset just after the message (its closing tokens included), strictly increasing.
    ``spliced``: assistant messages whose generated ids were spliced in (wholly or partly).
    ``canonical``: tokenizing piece by piece gave the same ids as tokenizing ``text`` whole
    (before splicing; spliced reply ids are generated ids, not a tokenization); None when
    not checked (a :class:`PromptBuilder` with ``check_whole=False`` whose pieces were known
    to decode to the text).
    ``fallback``: why splicing was abandoned for this prompt ("" when it was not).
    """

    token_ids: tuple[int, ...]
    boundaries: tuple[tuple[int, str], ...]
    text: str = ""
    spliced: int = 0
    canonical: bool | None = True
    fallback: str = ""


@dataclass(frozen=True, eq=False)
class _Msg:
    role: str
    content: str
    token_ids: tuple[int, ...] | None
    fields: dict[str, Any]  # the set tool fields, as given (tool_fields.TOOL_FIELDS)

    def template(self, content: str | None = None, fields: dict | None = None) -> dict:
        """The message as the template gets it (``content``/``fields`` replaced if given)."""
        return template_message(
            self.role,
            self.content if content is None else content,
            self.fields if fields is None else fields,
        )


@dataclass(frozen=True)
class _Span:
    content_start: int
    content_end: int | None  # None: no content span known (boundary only)
    end: int
    text: tuple[tuple[int, int], ...] = ()  # special spellings in tool fields, as text
    reply_start: int | None = None  # where a reply without a content span begins


def _as_msg(m: Any) -> _Msg:
    if isinstance(m, Mapping):
        role, content, ids = m["role"], m.get("content"), m.get("token_ids")
    else:
        role, content, ids = m.role, m.content, getattr(m, "token_ids", None)
    ids = tuple(ids) if ids is not None else None
    return _Msg(role, "" if content is None else content, ids, message_fields(m))


def _render(
    tokenizer: Tokenizer,
    messages: list[dict],
    add_generation_prompt: bool,
    options: Mapping[str, Any] | None = None,
) -> str:
    """The template's text; ``options``: ``tools``/``enable_thinking`` to pass through."""
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **(options or {})
    )
    if not isinstance(text, str):
        raise TypeError("apply_chat_template(tokenize=False) must return a str")
    return text


@dataclass(frozen=True)
class _Rendered:
    """What rendering ``messages[:i+1]`` told about message ``i``: the render's length and
    hash (to check it is a prefix of a later full render), the content span in it, the
    special spellings of its tool fields (``text``) and, for a reply without a content
    span, where the generation prompt ends (``reply_start``)."""

    length: int
    text_hash: int
    content: tuple[int, int] | None
    text: tuple[tuple[int, int], ...] = ()
    reply_start: int | None = None


def _render_message(
    tokenizer: Tokenizer,
    plain: list[dict],
    i: int,
    options: Mapping[str, Any],
    specials: tuple[str, ...],
) -> _Rendered | None:
    msg = plain[i]
    try:
        rendered = _render(tokenizer, plain[: i + 1], False, options)
        probe = _render(tokenizer, [*plain[:i], {**msg, "content": SENTINEL}], False, options)
    except Exception:  # noqa: BLE001 -- a template may refuse a partial conversation
        return None
    content = None
    if probe.count(SENTINEL) == 1:
        pre, post = probe.split(SENTINEL)
        fits = len(pre) + len(post) <= len(rendered)
        if fits and rendered.startswith(pre) and rendered.endswith(post):
            content = (len(pre), len(rendered) - len(post))
    fields = {k: v for k, v in msg.items() if k not in ("role", "content")}
    text: tuple[tuple[int, int], ...] = ()
    if fields and spells_special(fields, specials):
        marked, spellings = mark_specials(fields, specials)
        try:
            probe = _render(tokenizer, [*plain[:i], {**msg, **marked}], False, options)
            text = tuple(marked_ranges(rendered, probe, spellings))
        except Exception:  # noqa: BLE001
            pass
    reply_start = None
    if msg["role"] == "assistant" and content is None and i > 0:
        try:
            head = _render(tokenizer, plain[:i], True, options)
            reply_start = len(head) if rendered.startswith(head) else None
        except Exception:  # noqa: BLE001
            pass
    return _Rendered(len(rendered), hash(rendered), content, text, reply_start)


class PromptBuilder:
    """Builds prompts for one tokenizer, remembering what rendering each conversation
    prefix told (keyed by a sha256 chain over roles and contents), so that turn k+1 renders
    the template only for its new messages: 2 renders per message are O(n^2) text over a
    conversation without it. Piece tokenizations and splice decisions are cached too. At
    most ``max_entries`` of each are kept (LRU). Thread-safe.

    Measured with demo's template and tokenizer (100 turns, 38k tokens): one-shot
    :func:`build_prompt` 470 ms; a builder's build of the next turn ~120 ms, most of it
    one whole-text tokenization (the ``canonical`` and fallback check).

    ``max_renders`` bounds the prefix renders of one build to the last that many messages
    not yet seen (the others get no span: no boundary, no splice, tokenized with their
    neighbours), so a build of n unseen messages costs O(n) renders' worth of text, not
    O(n^2): ``tierchat serve`` sets it, as any client may send a long new conversation
    (docs/DESIGN.md §15). None: every message is rendered once.

    ``check_whole=False`` skips the whole-text tokenization (and the decodes that compare
    it) when the tokenizer decodes byte by byte (a ``ByteLevel`` decoder: Qwen2, Llama 3,
    GPT-2) and every piece decodes back to its own text (checked once per piece, cached):
    then the ids decode to the prompt's text, which is all the fallback asks, and only
    ``canonical`` goes unknown (None). The result is otherwise the same. At 124K tokens of
    a Claude Code session (Qwen tokenizer, this CPU) a build went from 0.31 s to ~0.03 s,
    the rest of each new turn's prompt time at a client."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_entries: int = 4096,
        max_renders: int | None = None,
        check_whole: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_renders = max_renders
        self.check_whole = check_whole or not ranges.decodes_byte_by_byte(tokenizer)
        self._cache: OrderedDict[bytes, _Rendered | None] = OrderedDict()
        self._pieces: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()
        self._exact: OrderedDict[tuple[str, bool], bool] = OrderedDict()
        self._specials: tuple[str, ...] | None = None
        self._splices: OrderedDict[tuple, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def _remember(self, cache: OrderedDict, key, value) -> None:
        with self._lock:
            cache[key] = value
            while len(cache) > self.max_entries:
                cache.popitem(last=False)

    def _encode(self, text: str, as_text: bool = False) -> list[int]:
        """Token ids of one piece of prompt text (cached: pieces repeat every turn);
        ``as_text``: message content, special tokens' spellings as plain text."""
        ids = self._pieces.get((text, as_text))
        if ids is None:
            ids = (
                encode_text(self.tokenizer, text)
                if as_text
                else encode_markup(self.tokenizer, text)
            )
            self._remember(self._pieces, (text, as_text), ids)
        return ids

    def _decodes_back(self, text: str, as_text: bool) -> bool:
        """Whether the ids of piece ``text`` (:meth:`_encode`) decode to ``text`` (cached)."""
        key = (text, as_text)
        exact = self._exact.get(key)
        if exact is None:
            exact = decode_ids(self.tokenizer, self._encode(text, as_text)) == text
            self._remember(self._exact, key, exact)
        return exact

    @property
    def specials(self) -> tuple[str, ...]:
        """:func:`special_spellings` of the tokenizer (computed once)."""
        if self._specials is None:
            self._specials = special_spellings(self.tokenizer)
        return self._specials

    def _splice(self, ids: tuple[int, ...], full: str, span: _Span) -> tuple[int, int]:
        """``(n, nchars)``: splice ``ids[:n]``, covering ``nchars`` characters of ``full``
        from the content start (cached per message text and ids)."""
        key = (full[span.content_start : span.end], span.content_end - span.content_start, ids)
        hit = self._splices.get(key)
        if hit is None:
            n = splice_len(
                self.tokenizer, ids, full, span.content_start, span.content_end, span.end
            )
            hit = (n, len(decode_ids(self.tokenizer, ids[:n])) if n else 0)
            self._remember(self._splices, key, hit)
        return hit

    def build(
        self,
        messages: Iterable[Any],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> Prompt:
        """See :func:`build_prompt`."""
        options = _options(tools, enable_thinking)
        return _build(self.tokenizer, messages, add_generation_prompt, self, options)

    def _spans(
        self, msgs: list[_Msg], plain: list[dict], full: str, options: Mapping[str, Any]
    ) -> list[_Span | None]:
        spans: list[_Span | None] = []
        prev_end = 0
        digests = []
        digest = hashlib.sha256(_options_key(options)).digest() if options else b""
        for m in msgs:
            body = m.content.encode("utf-8", "surrogatepass")
            digest = hashlib.sha256(
                digest + m.role.encode() + b"\0%d\0" % len(body) + body + fields_key(m.fields)
            ).digest()
            digests.append(digest)
        with self._lock:
            unseen = [i for i, d in enumerate(digests) if d not in self._cache]
        if self.max_renders is not None:
            # the last max_renders of them (a start below 0 would count from the end)
            unseen = unseen[max(0, len(unseen) - self.max_renders) :] if self.max_renders else []
            skipped = set(range(len(msgs))) - set(unseen)
        else:
            skipped = set()
        for i, digest in enumerate(digests):
            with self._lock:
                hit = digest in self._cache
                info = self._cache.get(digest)
                if hit:
                    self._cache.move_to_end(digest)
            if not hit and i in skipped:
                spans.append(None)
                continue
            if not hit:
                info = _render_message(self.tokenizer, plain, i, options, self.specials)
                self._remember(self._cache, digest, info)
            ok = (
                info is not None
                and prev_end < info.length <= len(full)
                and hash(full[: info.length]) == info.text_hash
            )
            if not ok:
                spans.append(None)
                continue
            prev_end = info.length
            if info.content is None:
                span = _Span(info.length, None, info.length, info.text, info.reply_start)
            else:
                span = _Span(info.content[0], info.content[1], info.length, info.text)
            spans.append(span)
        return spans


def _options(
    tools: Sequence[Mapping[str, Any]] | None, enable_thinking: bool | None
) -> dict[str, Any]:
    """The template keyword arguments of a build: ``tools`` and ``enable_thinking`` when
    given (None: not passed, the template's default)."""
    options: dict[str, Any] = {}
    if tools is not None:
        options["tools"] = [dict(t) if isinstance(t, Mapping) else t for t in tools]
    if enable_thinking is not None:
        options["enable_thinking"] = enable_thinking
    return options


def _options_key(options: Mapping[str, Any]) -> bytes:
    return json.dumps(options, sort_keys=True, ensure_ascii=True, default=str).encode()


def build_prompt(
    tokenizer: Tokenizer,
    messages: Iterable[Any],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool | None = None,
) -> Prompt:
    """The prompt for ``messages`` (the active path: ``Node`` objects or mappings with
    ``role`` (``"tool"`` included), ``content`` (None: empty), optional ``token_ids`` and
    the tool fields ``tool_calls``, ``tool_call_id``, ``name``, ``reasoning_content``;
    see core/chat/tool_fields.py), with generated ids spliced in. One-shot; a
    :class:`PromptBuilder` caches template renders across turns.

    ``tools``: OpenAI function tools (``[{"type": "function", "function": {"name",
    "description", "parameters"}}]``), passed to every render of the template;
    ``enable_thinking``: passed when not None (None: the template's default).

    Raises ``TypeError`` if the tokenizer's template does not render to text, and whatever
    the template raises for the full conversation (e.g. roles it does not allow).
    """
    options = _options(tools, enable_thinking)
    return _build(tokenizer, messages, add_generation_prompt, PromptBuilder(tokenizer), options)


def _build(
    tokenizer: Tokenizer,
    messages: Iterable[Any],
    add_generation_prompt: bool,
    builder,
    options: Mapping[str, Any],
) -> Prompt:
    """The body of :func:`build_prompt`; ``builder`` (a :class:`PromptBuilder`) caches."""
    msgs = [_as_msg(m) for m in messages]
    plain = [m.template() for m in msgs]
    full = _render(tokenizer, plain, add_generation_prompt, options)
    spans = builder._spans(msgs, plain, full, options)

    cuts = {0, len(full)}
    splices: dict[int, tuple[int, ...]] = {}  # char start -> ids covering [start, stop)
    stops: dict[int, int] = {}
    content = ranges.content_ranges(msgs, spans, full, builder.specials)
    for a, b in _tools_text(tokenizer, plain, full, add_generation_prompt, options, builder):
        if not any(x < b and a < y for x, y in content.items()):
            content[a] = b
    for a, b in content.items():
        cuts.update((a, b))
    for m, span in zip(msgs, spans, strict=True):
        if span is None:
            continue
        cuts.add(span.end)
        if span.content_end is None and span.reply_start is not None:
            # a reply rendered without content (tool calls only): splice from its start
            span = _Span(span.reply_start, span.reply_start, span.end)
        if span.content_end is None:
            continue
        if m.role == "assistant" and m.token_ids:
            j, nchars = builder._splice(m.token_ids, full, span)
            if j:
                stop = span.content_start + nchars
                splices[span.content_start] = m.token_ids[:j]
                stops[span.content_start] = stop
                cuts.add(stop)
    ordered = []  # no cut inside a spliced range
    inside_until = -1
    for c in sorted(cuts | stops.keys()):
        if c < inside_until:
            continue
        ordered.append(c)
        inside_until = stops.get(c, -1)
    ids: list[int] = []
    plain_ids: list[int] = []
    offset_of: dict[int, int] = {0: 0}
    starts = sorted(content)
    pieces = []
    for a, b in itertools.pairwise(ordered):
        pieces.append((full[a:b], ranges.inside(starts, content, a, b)))
        piece = builder._encode(*pieces[-1])
        plain_ids.extend(piece)
        ids.extend(splices.get(a, piece))
        offset_of[b] = len(ids)

    # byte by byte, ids decode to the concatenation of their texts: pieces that decode
    # back, and splices that decode to the text they cover (_splice), decode to ``full``
    # (no U+FFFD in it: a splice ending inside a character would decode to one)
    canonical: bool | None = None
    exact = (
        not builder.check_whole
        and "\ufffd" not in full
        and all(builder._decodes_back(*x) for x in pieces)
    )
    if not exact:
        whole = ranges.encode_whole(builder, full, content)
        fallback = ""
        if plain_ids != whole and decode_ids(tokenizer, plain_ids) != decode_ids(tokenizer, whole):
            fallback = "tokenizing the prompt piece by piece changes its text"
        elif splices and decode_ids(tokenizer, ids) != decode_ids(tokenizer, whole):
            fallback = "spliced reply ids do not decode to the prompt text"
        if fallback:
            boundaries = ranges.fallback_boundaries(tokenizer, msgs, spans, full, whole)
            return Prompt(tuple(whole), boundaries, full, 0, True, fallback)
        canonical = plain_ids == whole

    boundaries: list[tuple[int, str]] = []
    for m, span in zip(msgs, spans, strict=True):
        if span is not None and span.end in offset_of:
            end = offset_of[span.end]
            if not boundaries or end > boundaries[-1][0]:
                boundaries.append((end, m.role))
    return Prompt(tuple(ids), tuple(boundaries), full, len(splices), canonical, "")


def _tools_text(
    tokenizer: Tokenizer,
    plain: list[dict],
    full: str,
    add_generation_prompt: bool,
    options: Mapping[str, Any],
    builder,
) -> list[tuple[int, int]]:
    """The special spellings inside ``tools`` (a description that spells ``<|im_end|>``)
    as ranges of ``full`` to tokenize as text, found as the tool fields' are
    (tool_fields.marked_ranges; one more render, only when a tool spells one)."""
    tools = options.get("tools")
    if not tools or not spells_special({"tools": tools}, builder.specials):
        return []
    marked, spellings = mark_specials({"tools": tools}, builder.specials)
    try:
        probe = _render(tokenizer, plain, add_generation_prompt, {**options, **marked})
    except Exception:  # noqa: BLE001
        return []
    return marked_ranges(full, probe, spellings)
