"""Token ids and the text they stand for, for one tokenizer (docs/DESIGN.md §4): template
markup encoded with its special tokens, message content encoded as text, ids decoded
without clean-up, the special tokens' spellings, and how many of a reply's generated ids
match the text its prompt renders (the splice of core/chat/prompts.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..api import Tokenizer


def encode_markup(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of template text as markup: special tokens' spellings are the special
    tokens, no BOS/EOS added (the template's text holds them)."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text`` as plain text: the spelling of a special token
    (``<|im_end|>``, ``<|user|>``) becomes ordinary tokens, as llama.cpp and the OpenAI API
    treat message content (Hugging Face ``split_special_tokens``; a tokenizer without that
    option has no special tokens to split). ``add_special_tokens``: the tokenizer's own
    BOS/EOS around it, for a raw completion prompt (docs/DESIGN.md §4)."""
    if not text:
        return []
    try:
        ids = tokenizer.encode(
            text, add_special_tokens=add_special_tokens, split_special_tokens=True
        )
    except TypeError:  # tokenizers without that option (the test fake)
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(ids)


def special_spellings(tokenizer: Tokenizer) -> tuple[str, ...]:
    """The text of every special (control) token of ``tokenizer``: added tokens marked
    special, else ``all_special_tokens``; () when it names none."""
    out: set[str] = set()
    try:
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        out.update(str(t) for t in added.values() if getattr(t, "special", False))
    except Exception:  # noqa: BLE001 -- a tokenizer without that table
        pass
    try:
        out.update(str(t) for t in getattr(tokenizer, "all_special_tokens", None) or ())
    except Exception:  # noqa: BLE001
        pass
    return tuple(sorted(t for t in out if t))


def decode_ids(tokenizer: Tokenizer, ids: Sequence[int], *, skip_special: bool = False) -> str:
    """``ids`` as text, without the tokenizer's clean-up of spaces (the text must be the
    one the ids stand for); ``skip_special`` drops special tokens (a reply's end token)."""
    special = {"skip_special_tokens": True} if skip_special else {}
    try:
        return tokenizer.decode(list(ids), clean_up_tokenization_spaces=False, **special)
    except TypeError:  # tokenizers without the clean-up option (the test fake)
        return tokenizer.decode(list(ids), **special)


def splice_len(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    full: str,
    start: int,
    content_end: int,
    end: int,
) -> int:
    """How many of a reply's generated ``ids`` to splice into the rendered prompt ``full``
    where its content starts (``start``; the content ends at ``content_end``, the message
    at ``end``, characters): all of them when they decode to the text there (up to 3 end
    tokens the template does not show may be left out), else the longest prefix whose
    text is a prefix of the content (0: none; docs/DESIGN.md §4)."""
    # whole reply, or without a trailing EOS/extra special the template does not show
    for j in range(len(ids), max(len(ids) - 3, 0), -1):
        text = decode_ids(tokenizer, ids[:j])
        if start + len(text) <= end and full.startswith(text, start):
            if start + len(text) >= content_end:
                return j
            break
    # partial: the longest prefix whose text is a prefix of the content
    content = full[start:content_end]
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if content.startswith(decode_ids(tokenizer, ids[:mid])):
            lo = mid
        else:
            hi = mid - 1
    return lo
