"""The model's context length, and the check every front end runs before it submits a
prompt (docs/DESIGN.md §12, §15): the TUI, ``tierchat chat`` and ``replay`` through
:class:`~tierchat.core.chat.session.ChatSession`, ``tierchat serve`` through its 400.

A prompt must leave room for one token; a ``max_tokens`` the caller gave explicitly must
fit beside it (OpenAI's rule), while a default is capped to the room left. Nothing is
prefilled for a prompt that fails the check.
"""

from __future__ import annotations

from typing import Any

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


def config_int(engine: Any, keys: tuple[str, ...]) -> int | None:
    """The first positive int among ``keys`` in the engine's loaded model's args, or in
    their ``text_config`` (multimodal wrappers such as Qwen3.5 keep the text model's
    there); None when none is set."""
    loaded = getattr(engine, "loaded", None)
    args = getattr(getattr(loaded, "model", None), "args", None)
    text = getattr(args, "text_config", None)
    for source in (args, text):
        for key in keys:
            value = source.get(key) if isinstance(source, dict) else getattr(source, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def context_length(engine: Any) -> int | None:
    """The model's context length in tokens: the engine's, else ``max_position_embeddings``
    of the args' ``text_config``; None when unknown."""
    value = getattr(engine, "context_length", None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return config_int(engine, ("max_position_embeddings", "max_seq_len", "n_ctx"))
