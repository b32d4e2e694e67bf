"""The model's context length, and the check every front end runs before it submits a
prompt (docs/DESIGN.md §12, §15): the TUI, ``tierchat chat`` and ``replay`` through
:class:`~tierchat.core.chat.session.ChatSession`, ``tierchat serve`` through its 400.

A prompt must leave room for one token; a ``max_tokens`` the caller gave explicitly must
fit beside it (OpenAI's rule), while a default is capped to the room left. Nothing is
prefilled for a prompt that fails the check.
"""

from __future__ import annotations

from ..api import EngineLike
from ..units import fmt_count


class ContextLimitExceeded(ValueError):
    """A prompt that cannot fit the model's context. ``prompt_tokens``, ``max_tokens``
    (what was asked; counted only when ``explicit``) and ``context_length`` in tokens; the
    message gives the numbers and what to do about them."""

    def __init__(
        self, prompt_tokens: int, max_tokens: int, context_length: int, explicit: bool
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length
        self.explicit = explicit
        n, ctx = fmt_count(prompt_tokens), fmt_count(context_length)
        if prompt_tokens >= context_length:
            what = f"the prompt is {n} tokens; the model's context is {ctx}"
            hint = "shorten the message, or start a new branch (edit an earlier message)"
        else:
            total = fmt_count(prompt_tokens + max_tokens)
            what = (
                f"the prompt is {n} tokens + {fmt_count(max_tokens)} to generate = {total}; "
                f"the model's context is {ctx}"
            )
            hint = (
                f"lower max_tokens to at most {fmt_count(context_length - prompt_tokens)}, "
                "shorten the message, or start a new branch"
            )
        super().__init__(f"{what}: {hint}")


def generation_room(
    prompt_tokens: int, max_tokens: int, context_length: int | None, *, explicit: bool
) -> int:
    """The ``max_tokens`` to generate for a prompt of ``prompt_tokens``: ``max_tokens``,
    capped to the room left when it was a default (not ``explicit``). ``context_length``
    None: unknown, unchecked. Raises :class:`ContextLimitExceeded` when the prompt leaves
    no room, or an explicit ``max_tokens`` does not fit beside it."""
    if context_length is None:
        return max_tokens
    n = prompt_tokens
    if n >= context_length or (explicit and n + max_tokens > context_length):
        raise ContextLimitExceeded(n, max_tokens, context_length, explicit)
    return min(max_tokens, context_length - n)


def context_length(engine: EngineLike) -> int | None:
    """The loaded model's context length in tokens (its ``ModelInfo``); None when unknown
    or no model is loaded."""
    info = engine.info
    return info.context_length if info is not None else None
