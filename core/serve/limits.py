"""What ``tierchat serve`` checks before any work is queued. Pure Python: no MLX, no HTTP.

A request from the network is hostile until checked (docs/DESIGN.md §15). A server on loopback is
reachable by every web page the user opens (a ``text/plain`` POST needs no CORS
preflight) and, through DNS rebinding, under a name that resolves to 127.0.0.1. So:

- :func:`check_host` / :func:`check_origin`: the ``Host`` header must name a loopback
  address or a configured host, and an ``Origin`` header (sent by browsers) a loopback
  origin or a configured one; otherwise 403.
- :func:`parse_body`: ``application/json`` only, at most ``max_body_bytes``; JSON numbers
  finite (no ``NaN``, ``Infinity``, ``1e400``), integers of at most
  :data:`MAX_INT_DIGITS` digits, nesting at most :data:`MAX_DEPTH` deep.
- :func:`check_prompt`: every token id in ``[0, vocab)`` (an id past the embedding table
  reads out-of-bounds memory or crashes the process), and prompt + reply within the
  model's context: 400 ``context_length_exceeded`` as OpenAI answers, before any prefill.

Every failure is an :class:`~tierchat.core.serve.prompts.APIError` in OpenAI's shape.
"""

from __future__ import annotations

import ipaddress
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..api import EngineLike
from ..chat.context_limit import ContextLimitExceeded, generation_room
from ..chat.context_limit import context_length as context_length  # re-exported for serve
from ..text import one_line
from .prompts import APIError

MAX_INT_DIGITS = 20  # a 64-bit seed has 20 digits; more is never a real parameter
MAX_DEPTH = 64  # JSON nesting: a chat body is 5 deep


@dataclass(frozen=True)
class ServeLimits:
    """Bounds on what one request may ask. Sizes in bytes, times in seconds.

    ``allowed_hosts``: extra names accepted in ``Host`` (beyond loopback and the bound
    address); ``allowed_origins``: extra browser origins (``scheme://host[:port]``, or
    ``*`` for any). ``max_connections`` and ``header_timeout_s`` bound uvicorn's
    connections (:func:`~tierchat.core.serve.server.guarded_protocol`: past the first, a
    request gets 503 with ``Retry-After``; a connection's headers must come within the
    second)."""

    max_body_bytes: int = 4 << 20
    max_messages: int = 1024
    max_connections: int = 256
    header_timeout_s: float = 10.0
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = field(default=())


# ---------------------------------------------------------------- Host and Origin


def is_loopback(host: str) -> bool:
    """Whether ``host`` names the loopback interface: the one rule for the ``Host`` and
    ``Origin`` headers and for what ``tierchat serve --host`` may bind without
    ``--allow-remote`` (docs/DESIGN.md §15).

    True for a loopback IP address (IPv4 ``127.0.0.0/8``, IPv6 ``::1``, bracketed or not,
    and ``::ffff:127.x.y.z``, IPv4 loopback mapped into IPv6) and for ``localhost`` and
    names under ``.localhost`` (RFC 6761 §6.3 reserves them for loopback; browsers
    resolve them so). Case, white space around it and one trailing dot are ignored.
    False for the wildcards ``0.0.0.0`` and ``::`` (every interface), the empty string,
    any other address and any other name: a name's resolution can change, so only the
    reserved names pass (a bind resolves the name as well: ``cli/serve.py``)."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    name = host[:-1] if host.endswith(".") else host
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def host_name(value: str) -> str:
    """The host of a ``Host`` header value: the port and an IPv6 literal's brackets off."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def check_host(value: str | None, bound: str, limits: ServeLimits) -> None:
    """Accept a missing ``Host`` (HTTP/1.0), a loopback one, the address the server is
    bound to (when not a wildcard) or a configured name. Raises :class:`APIError` 403."""
    if value is None:
        return
    name = host_name(value)
    allowed = {h.lower() for h in limits.allowed_hosts}
    if bound not in ("0.0.0.0", "::", ""):
        allowed.add(host_name(bound))
    if is_loopback(name) or name in allowed or "*" in allowed:
        return
    raise APIError(
        f"Host {one_line(value)!r} is not allowed: use a loopback address, or "
        "start the server with --allowed-host NAME",
        403,
        "permission_error",
        code="host_not_allowed",
    )


def check_origin(value: str | None, limits: ServeLimits) -> None:
    """Accept no ``Origin`` (not a browser), a loopback origin (``http://localhost:3000``)
    or a configured one. Raises :class:`APIError` 403 (``null`` included)."""
    if value is None:
        return
    allowed = {o.rstrip("/").lower() for o in limits.allowed_origins}
    origin = value.strip().rstrip("/").lower()
    if "*" in allowed or origin in allowed:
        return
    parts = urlsplit(origin)
    if parts.scheme in ("http", "https") and parts.hostname and is_loopback(parts.hostname):
        return
    raise APIError(
        f"Origin {one_line(value)!r} is not allowed: a web page cannot drive this "
        "server; start it with --allowed-origin ORIGIN to let one",
        403,
        "permission_error",
        code="origin_not_allowed",
    )


# ---------------------------------------------------------------- the body


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise APIError(f"number {text[:24]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise APIError(f"integer of {len(text)} digits is out of range")
    return int(text)


def _no_constant(name: str) -> Any:
    raise APIError(f"{name} is not a JSON number")


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of parsed JSON, iteratively (no recursion on hostile input)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if d > limit:
            return d
        deepest = max(deepest, d)
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node)
    return deepest


def _bad_unicode(obj: Any) -> tuple[str, str] | None:
    """``(param, what)`` of the first string (key or value) of parsed JSON that is not
    valid Unicode: a lone surrogate, which JSON's ``\\udc80`` escape can spell and no
    tokenizer or UTF-8 writer accepts; None when all are valid. Iterative."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            items: list[tuple[Any, str]] = []
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as e:
                return path, f"lone surrogate U+{ord(node[e.start]):04X} at character {e.start}"
        elif isinstance(node, dict):
            items = []
            for k, v in node.items():
                where = f"{path}.{k}" if path else str(k)
                items += [(k, path or "body"), (v, where)]
        elif isinstance(node, list):
            items = [(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node)]
        else:
            items = []
        stack.extend(reversed(items))
    return None


def parse_body(content_type: str | None, raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object. Raises :class:`APIError`: 415 unless the media
    type is ``application/json``; 400 for bad JSON, non-finite or huge numbers, nesting
    deeper than :data:`MAX_DEPTH`, a body that is not an object, or a string that is
    not valid Unicode (``invalid_unicode``, naming its param)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise APIError(
            f"Content-Type must be application/json, not {one_line(media) or 'none'!r}",
            415,
            code="unsupported_media_type",
        )
    try:
        body = json.loads(
            raw,
            parse_float=_finite,
            parse_int=_bounded_int,
            parse_constant=_no_constant,
        )
    except APIError:
        raise
    except RecursionError:  # the C decoder's own depth guard ("[" * 2000)
        raise APIError("the request body nests too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise APIError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if _depth(body, MAX_DEPTH) > MAX_DEPTH:
        raise APIError(f"the request body nests deeper than {MAX_DEPTH} levels")
    bad = _bad_unicode(body)
    if bad is not None:
        param, what = bad
        safe = param.encode("utf-8", "backslashreplace").decode()[:80]
        raise APIError(f"{safe} is not valid Unicode ({what})", param=safe, code="invalid_unicode")
    return body


# ---------------------------------------------------------------- the prompt


def check_prompt(
    ids: Sequence[int],
    max_tokens: int,
    *,
    explicit: bool,
    vocab: int | None,
    context: int | None,
    param: str = "messages",
) -> int:
    """Check a prompt's ids and length; return the ``max_tokens`` to generate.

    Ids must lie in ``[0, vocab)`` (unchecked when ``vocab`` is None). The prompt must
    leave room for one token in ``context``; a client's own ``max_tokens`` (``explicit``)
    must fit beside the prompt, as OpenAI checks, while the server's default is capped to
    the room left. Raises :class:`APIError` 400 (``invalid_token_id`` or
    ``context_length_exceeded``)."""
    if vocab is not None:
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise APIError(
                f"token id {bad} is outside the vocabulary [0, {vocab})",
                param="prompt",
                code="invalid_token_id",
            )
    n = len(ids)
    try:
        return generation_room(n, max_tokens, context, explicit=explicit)
    except ContextLimitExceeded:
        asked = f"{n} in the prompt" + (f" + {max_tokens} to generate" if explicit else "")
        raise APIError(
            f"this model's maximum context length is {context} tokens; the request asks for "
            f"{asked}",
            param="max_tokens" if context is not None and n < context else param,
            code="context_length_exceeded",
        ) from None


def model_vocab(engine: EngineLike) -> int | None:
    """The ids the loaded model may generate (its ``ModelInfo.vocab_size``: the logits'
    last dimension), even past the ones its tokenizer names; None when unknown."""
    info = engine.info
    return info.vocab_size if info is not None and info.vocab_size > 0 else None


def vocab_size(engine: EngineLike) -> int | None:
    """The number of valid token ids of the engine's model: :func:`model_vocab`, else the
    tokenizer's size (``len(tokenizer)``, added tokens included, or its ``vocab_size``);
    None when none is known."""
    rows = model_vocab(engine)
    if rows is not None:
        return rows
    tokenizer = engine.tokenizer
    try:
        return len(tokenizer)  # type: ignore[arg-type]
    except TypeError:
        size = getattr(tokenizer, "vocab_size", None)
        return size if isinstance(size, int) and size > 0 else None


# The count flags of ServeLimits: (field, help with ``{}`` for the default). The flag is
# the field's name with dashes (``--max-body-bytes``); one table for the parser and
# limits_from_args.
_COUNT_FLAGS = (
    ("max_body_bytes", "refuse larger request bodies with 413 (default {})"),
    ("max_messages", "refuse chats of more messages (default {})"),
    ("max_connections", "open connections at most (default {}; past it: 503 with Retry-After)"),
)


def add_limit_flags(parser: Any) -> None:
    """The ``tierchat serve`` flags of :class:`ServeLimits` (and the shutdown bound)."""
    d = ServeLimits()
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also accept this Host header (repeatable; loopback names always pass)",
    )
    parser.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages from ORIGIN (scheme://host[:port], or *) call the server",
    )
    for name, help_text in _COUNT_FLAGS:
        default = getattr(d, name)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=default,
            metavar="N",
            help=help_text.format(default),
        )
    parser.add_argument(
        "--shutdown-s",
        type=float,
        default=10.0,
        metavar="S",
        help="on SIGTERM/SIGINT, wait at most S seconds to write queued SSD entries",
    )


def limits_from_args(args: Any) -> ServeLimits:
    """:class:`ServeLimits` from the flags of :func:`add_limit_flags`."""
    d = ServeLimits()
    return ServeLimits(
        **{name: getattr(args, name, getattr(d, name)) for name, _ in _COUNT_FLAGS},
        allowed_hosts=tuple(getattr(args, "allowed_host", ()) or ()),
        allowed_origins=tuple(getattr(args, "allowed_origin", ()) or ()),
    )
