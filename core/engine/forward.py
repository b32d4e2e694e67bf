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

A folded chunk computes its last layer for every token, where a prefill that ends before N
skips that layer's output lazily (only its K/V are needed). On a GPU that is a small part
of a chunk; on the CPU, where the attention over a long context is most of a small
model's chunk, it doubled a 2-layer model's chunk. With ``split_last_layer`` the last
layer runs twice inside the one graph: on the chunk's first ``L - 1`` tokens (its output
unused, so MLX computes only their K/V) and on the last token, which attends to all of
them: the last layer's attention and MLP for one position only, every other layer once
for the whole chunk (:class:`_SplitLastLayer`). It applies where the last layer takes only
the hidden states, a causal mask and a plain ``KVCache``, and its RoPE does not depend on
the call's length; elsewhere that layer runs whole.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

LastLogits = Callable[..., mx.array]  # (tokens, cache[, last]) -> logits


def _causal(mask: Any) -> bool:
    return mask is None or (isinstance(mask, str) and mask == "causal")


def _position_dependent_rope(layer: Any) -> bool:
    """Whether ``layer`` holds a RoPE whose frequencies depend on the call's length
    (mlx-lm's ``DynamicNTKScalingRoPE`` and the copies named alike): the split's two calls
    would rotate its keys with other bases than one call does."""
    modules = getattr(layer, "modules", None)
    return callable(modules) and any("Dynamic" in type(m).__name__ for m in modules())


class _SplitLastLayer:
    """Stands in for a trunk's last layer during one call: runs it on the first ``L - 1``
    positions (output unused: only their K/V are computed) and then on the last position,
    returning ``(B, 1, D)``. ``split`` counts the calls it split; it runs the layer whole
    (once, as the trunk called it) unless the call has only the hidden states, a causal
    mask (or none) and a plain ``KVCache`` (or ``QuantizedKVCache``): other per-token
    arguments, array masks and window caches are not cut."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.signature = inspect.signature(layer.__call__)
        self.split = 0

    def __getattr__(self, name: str) -> Any:  # a trunk that reads its layers' attributes
        return getattr(self.layer, name)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        try:
            bound = self.signature.bind(x, *args, **kwargs)
        except TypeError:
            return self.layer(x, *args, **kwargs)
        first = next(iter(bound.arguments))  # the hidden states, whatever their name
        given = set(bound.arguments)
        n = x.shape[1]
        if (
            n < 2
            or not given <= {first, "mask", "cache"}
            or not _causal(bound.arguments.get("mask"))
            or type(bound.arguments.get("cache")) not in (KVCache, QuantizedKVCache)
        ):
            return self.layer(x, *args, **kwargs)
        cache = bound.arguments["cache"]
        takes_mask = "mask" in self.signature.parameters
        head = {first: x[:, :-1], "cache": cache}
        last = {first: x[:, -1:], "cache": cache}
        if takes_mask:
            head["mask"], last["mask"] = ("causal" if n > 2 else None), None
        self.layer(**head)
        self.split += 1  # the first n - 1 positions' K/V are in the cache (lazily)
        return self.layer(**last)


def last_logits_fn(model: Any, split_last_layer: bool = False) -> LastLogits | None:
    """``f(tokens, cache) -> logits`` of the last position, shape ``(1, vocab)``, for
    ``tokens`` of shape ``(1, L)``, updating ``cache`` as ``model(tokens, cache)`` does;
    ``f(tokens, cache, last)`` for ``tokens`` of shape ``(B, L)``: the logits at position
    ``last[b]`` of each row ``b`` (``last``: shape ``(B,)``), shape ``(B, vocab)``;
    None when the model does not have the usual trunk + head layout. With
    ``split_last_layer`` the trunk's last layer computes its output for the last position
    only (module doc); ``f.splits()`` says how many calls did."""
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
    layers = getattr(trunk, "layers", None)
    if not isinstance(layers, list) or not layers or _position_dependent_rope(layers[-1]):
        split_last_layer = False
    counted = [0]

    def last_logits(tokens: mx.array, cache: list[Any], last: mx.array | None = None) -> mx.array:
        if last is not None:  # a batch of rows ending at their own positions (no split)
            hidden = trunk(tokens, cache=cache)
            at = mx.take_along_axis(hidden, last.reshape(-1, 1, 1), axis=1)
            return head(at)[:, -1, :]
        if split_last_layer and tokens.shape[1] > 1:
            original = layers[-1]
            proxy = _SplitLastLayer(original)
            layers[-1] = proxy
            try:
                hidden = trunk(tokens, cache=cache)
            finally:
                layers[-1] = original
            counted[0] += proxy.split
        else:
            hidden = trunk(tokens, cache=cache)
        return head(hidden[:, -1:, :])[:, -1, :]

    last_logits.splits = lambda: counted[0]  # type: ignore[attr-defined]
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
