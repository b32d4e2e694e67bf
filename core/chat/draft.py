"""How big the message being typed is: its own tokens, and the prompt it would be sent as
against the model's context length. Plain Python over the engine's tokenizer object (no
MLX), so the TUI can count while the user types (debounced, off the UI thread).

The prompt count is the one the engine will prefill: the same ``ChatSession.build_prompt``
that ``send`` uses, over the active path plus the draft as a new user message
(``tests/engine/test_contract.py`` checks it against the real engine's prompt length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .context_limit import context_length
from .prompts import encode_text


@dataclass(frozen=True)
class DraftCount:
    """``text_tokens``: the draft alone; ``prompt_tokens``: the whole prompt it would be
    sent as (system prompt, history, draft, generation prompt); ``context_length``: the
    model's context in tokens, None when the engine does not know it."""

    text_tokens: int
    prompt_tokens: int
    context_length: int | None

    @property
    def fraction(self) -> float | None:
        """``prompt_tokens / context_length``, None when the context length is unknown."""
        if not self.context_length:
            return None
        return self.prompt_tokens / self.context_length

    @property
    def over(self) -> bool:
        """The prompt alone fills the context (no room for a reply)."""
        return bool(self.context_length) and self.prompt_tokens >= self.context_length


def count_draft(session: Any, text: str) -> DraftCount | None:
    """Count ``text`` as the next user message of ``session`` (a ``ChatSession``).

    Returns None when no model is loaded (no tokenizer). Tokenizer and template errors
    propagate (the caller shows no count)."""
    engine = session.engine
    tokenizer = engine.tokenizer
    if tokenizer is None or not engine.model_name:
        return None
    path = session.active_path()
    messages = [
        *session.prompt_messages(path),
        {"role": "user", "content": text, "token_ids": None},
    ]
    prompt = session.build_prompt(messages)
    context = context_length(engine)
    return DraftCount(len(encode_text(tokenizer, text)), len(prompt.token_ids), context)
