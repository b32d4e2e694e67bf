"""A prefill chunk that also gives the first token's logits (the folded schedule).

mlx-lm's ``generate_step`` prefills ``prompt[:-1]`` and then feeds the last prompt token
through its first decode step: two forwards at least for any turn. A chunk that ends at
the prompt's end can give the first token's logits itself, one forward fewer; on a GPU
every forward has a floor (kernel launches, weight reads: about 5 ms for 8B weights at
3.35 TB/s on an H100), so a chat turn of a few hundred new tokens is roughly one floor
cheaper.

A model's full output has ``(1, L, vocab)`` logits: for a 2048-token chunk of a 152K
vocabulary that is 0.6 GB and a 0.3 TFLOP head matmul that only the last row is needed
of. :func:`last_logits_fn` runs the model's trunk (``model.model``) and applies its head
(``lm_head``, or the tied embedding's ``as_linear``) to the last position only. mlx-lm
models differ in their heads (soft-capping, scaling), so the engine checks the result
against the model's own forward once at load (:func:`verify_last_logits`) and folds only
where they agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

LastLogits = Callable[[mx.array, list[Any]], mx.array]


def last_logits_fn(model: Any) -> LastLogits | None:
    """``f(tokens, cache) -> logits`` of the last position, shape ``(1, vocab)``, for
    ``tokens`` of shape ``(1, L)``, updating ``cache`` as ``model(tokens, cache)`` does;
    None when the model does not have the usual trunk + head layout."""
    trunk = getattr(model, "model", None)
    if trunk is None or not callable(trunk):
        return None
    head = None
    if "lm_head" in getattr(model, "children", lambda: {})():
        head = model.lm_head
    else:
        embed = getattr(trunk, "embed_tokens", None)
        head = getattr(embed, "as_linear", None)
    if head is None:
        return None

    def last_logits(tokens: mx.array, cache: list[Any]) -> mx.array:
        hidden = trunk(tokens, cache=cache)
        return head(hidden[:, -1:, :])[:, -1, :]

    return last_logits


def verify_last_logits(model: Any, fn: LastLogits, make_cache: Callable[[], list[Any]]) -> bool:
    """Whether ``fn`` gives the model's own last-position logits on a 3-token probe
    (relative tolerance 1e-2 of the largest logit: the same ops in another matmul shape
    round differently in half precision, a missing soft-cap or scale is far off)."""
    tokens = mx.array([[0, 1, 2]])
    try:
        want = model(tokens, cache=make_cache())[:, -1, :].astype(mx.float32)
        got = fn(tokens, make_cache()).astype(mx.float32)
        if got.shape != want.shape:
            return False
        scale = float(mx.abs(want).max()) or 1.0
        return float(mx.abs(got - want).max()) <= 1e-2 * scale
    except Exception:  # a trunk with another signature: no folding
        return False


def logprobs_of(logits: mx.array) -> mx.array:
    """Log-probabilities of ``logits`` (shape ``(1, vocab)``), the very expression
    ``generate_step`` samples from."""
    return logits - mx.logsumexp(logits, keepdims=True)
