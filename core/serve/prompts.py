"""OpenAI request bodies -> prompts, for ``tierchat serve``. Pure Python: no MLX, no HTTP.

Clients resend the whole message list on every turn, with the assistant replies as text
(often with the reasoning removed). The prompt is built with the chat's
:class:`~tierchat.core.chat.prompts.PromptBuilder`, so its ids are the ones ``tierchat chat``
would use; a :class:`ReplyMemory` of recent replies maps an assistant message's text back to
the ids the model generated, and the builder splices them in where the rendered text
matches (docs/DESIGN.md §4). Turn k+1's prompt then extends turn k's sequence token-exactly and
the cache reuses all of it; where nothing matches the builder tokenizes the text and the
cache reuses the prefix up to that message.

Errors are :class:`APIError`: an HTTP status and OpenAI's error fields
(``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..api import Tokenizer
from ..chat.prompts import decode_ids, encode_text
from ..files import private_dirs, private_open
from ..sampling_params import SamplingError, SamplingParams

THINK_END = "</think>"
# the Retry-After of a 503 that names none (every 503 is worth retrying and says when)
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error answered as OpenAI does: ``status`` and the ``error`` object's fields.
    ``retry_after_s``: the ``Retry-After`` header; a 503 always has one (default
    :data:`RETRY_AFTER_S`)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        if retry_after_s is None and status == 503:
            retry_after_s = RETRY_AFTER_S
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class ReplyMemory:
    """Recent replies' text -> generated token ids (the newest ``max_entries``, LRU).

    A reply is remembered under its text and, when it holds ``</think>``, also under the
    text after it (with and without leading whitespace), mapped to the ids after the
    ``</think>`` token: a client that strips the reasoning still gets the generated ids.
    Wrong ids cannot corrupt a prompt: the builder splices ids only where their decoding
    equals the rendered text.

    With a ``path`` the memory survives a restart (JSON lines, appended as replies come,
    compacted on load; the file 0600 in a 0700 dir, as it holds every reply): the SSD tier's blocks are keyed by the generated ids, so without
    them a restarted server would miss from the first re-tokenized reply on. One file per
    model (the caller names it). Appends are whole lines or nothing; a full or read-only
    disk is said once on stderr and the memory goes on in RAM (appends are tried again
    with each reply).
    """

    def __init__(self, max_entries: int = 256, path: str | os.PathLike | None = None) -> None:
        self.max_entries = max_entries
        self.path = Path(path) if path is not None else None
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._lines = 0
        self._failing = False  # the last append failed (and was said)
        if self.path is not None:
            self._load()

    def _load(self) -> None:
        """Read the file (one JSON ``[text, ids]`` a line, oldest first); a bad line is
        skipped, a cut last line removed from the file; the file is rewritten when it
        holds more than twice what is kept."""
        assert self.path is not None
        try:
            raw = self.path.read_bytes()
            if raw and not raw.endswith(b"\n"):  # a cut last line (an older writer's)
                raw = raw[: raw.rfind(b"\n") + 1]
                os.truncate(self.path, len(raw))  # the next append starts a line
            lines = raw.decode("utf-8", "replace").splitlines()
        except FileNotFoundError:
            return
        except OSError:
            self.path = None  # unreadable: work in memory only
            return
        for line in lines:
            try:
                text, ids = json.loads(line)
                if isinstance(text, str) and all(isinstance(i, int) for i in ids):
                    self._entries[text] = tuple(ids)
                    self._entries.move_to_end(text)
            except (ValueError, TypeError):
                continue
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        self._lines = len(lines)
        if self._lines > 2 * self.max_entries:
            self._rewrite()

    def _rewrite(self) -> None:
        assert self.path is not None
        tmp = self.path.with_suffix(".tmp")
        body = "".join(json.dumps([t, list(i)]) + "\n" for t, i in self._entries.items())
        tmp.unlink(missing_ok=True)
        with private_open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL) as f:
            f.write(body)
        os.replace(tmp, self.path)
        self._lines = len(self._entries)

    def _append(self, keys: dict[str, tuple[int, ...]]) -> None:
        """Append ``keys``' lines in one write, whole or not at all: a write the disk cuts
        (``ENOSPC``) is truncated away, so no cut line is left for the next append to merge
        into. A failure is said once on stderr (until a write succeeds again); the
        entries stay in memory and serving goes on."""
        if self.path is None:
            return
        data = "".join(json.dumps([t, list(i)]) + "\n" for t, i in keys.items()).encode()
        try:
            private_dirs(self.path.parent, tighten=True)
            with private_open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) as f:
                _append_whole(f.fileno(), data)
            self._lines += len(keys)
            if self._lines > 2 * self.max_entries:
                self._rewrite()
        except OSError as e:
            if not self._failing:
                print(
                    f"warning: reply memory {self.path} not written ({e.strerror or e}); "
                    "replies are kept in memory only until a write succeeds",
                    file=sys.stderr,
                    flush=True,
                )
            self._failing = True
            return
        if self._failing:
            print(f"reply memory {self.path} is written again", file=sys.stderr, flush=True)
        self._failing = False

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, tokenizer: Tokenizer, text: str, token_ids: Sequence[int]) -> None:
        ids = tuple(int(i) for i in token_ids)
        if not text or not ids:
            return
        keys = {text: ids}
        if THINK_END in text:
            keys.update(_after_think(tokenizer, ids))
        with self._lock:
            for key, value in keys.items():
                self._entries[key] = value
                self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            self._append(keys)

    def lookup(self, text: str) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._entries.get(text)
            if ids is not None:
                self._entries.move_to_end(text)
            return ids


def _append_whole(fd: int, data: bytes) -> None:
    """Write ``data`` at the end of the ``O_APPEND`` file ``fd``, all of it or none:
    on an error (a full disk after part of it) the file is cut back to its old size and
    the error raised. One writer at a time (the caller's lock)."""
    start = os.fstat(fd).st_size
    done = 0
    try:
        while done < len(data):
            done += os.write(fd, data[done:])
    except OSError:
        os.ftruncate(fd, start)
        raise


def _after_think(tokenizer: Tokenizer, ids: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Keys for the answer after the last ``</think>``: its text -> its ids, and the same
    with leading whitespace tokens dropped."""
    out: dict[str, tuple[int, ...]] = {}
    for k in range(len(ids), 0, -1):
        if decode_ids(tokenizer, ids[:k], skip_special=True).endswith(THINK_END):
            break
    else:
        return out
    rest = ids[k:]
    while rest:
        text = decode_ids(tokenizer, rest, skip_special=True)
        if text:
            out.setdefault(text, rest)
        if not text[:1].isspace():
            break
        rest = rest[1:]
    return out


def completion_prompt(tokenizer: Tokenizer, body: Mapping[str, Any]) -> tuple[int, ...]:
    """The token ids of a ``/v1/completions`` ``prompt``: a string, or a list of token ids.
    A string is tokenized as text (with the tokenizer's BOS): a special token's spelling in
    it is ordinary tokens (docs/DESIGN.md §4); a client wanting control tokens sends ids.
    Raises :class:`APIError` otherwise (a list of several prompts is not supported)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = encode_text(tokenizer, prompt, add_special_tokens=True)
        except (TypeError, ValueError, UnicodeError):  # the tokenizer refuses this text
            raise APIError("'prompt' cannot be tokenized", param="prompt") from None
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids = prompt
    else:
        raise APIError(
            "'prompt' must be a string or a list of token ids (one prompt)", param="prompt"
        )
    if not ids:
        raise APIError("'prompt' is empty", param="prompt")
    return tuple(int(i) for i in ids)


def check_number(body: Mapping[str, Any], name: str, default, lo: float, hi: float, kind=float):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise APIError(f"'{name}' must be a number", param=name)
    if kind is int and value != int(value):
        raise APIError(f"'{name}' must be an integer", param=name)
    if not lo <= value <= hi:
        raise APIError(f"'{name}' must be between {_plain(lo)} and {_plain(hi)}", param=name)
    return kind(value)


def _plain(x: float) -> str:
    """A bound as a person writes it: ``1048576``, ``0.5`` (never ``1.04858e+06``)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# Parameters of the OpenAI API that tierchat does not implement: a request that sets one
# to anything but its neutral value gets a 400 naming it, never a silent ignore.
# name -> the values that mean "not used"
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),  # audio output
    "audio": (None,),  # its voice and format
    "prediction": (None,),  # predicted outputs
    "web_search_options": (None,),  # a search before the reply
}


def check_unsupported(body: Mapping[str, Any]) -> None:
    """Raise :class:`APIError` 400 ``unsupported_parameter`` naming the first parameter of
    :data:`UNSUPPORTED` that ``body`` sets to a value that would change the reply."""
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise APIError(
                f"'{name}' is not supported by this server",
                param=name,
                code="unsupported_parameter",
            )


def returned_tokens(
    tokenizer: Tokenizer, token_ids: Sequence[int], text: str, stopped: bool
) -> int:
    """How many of the generated ``token_ids`` the returned ``text`` holds: all of them,
    unless a stop string cut the reply (``stopped``); then the fewest whose decoding
    covers ``text`` (the tokens decoded past the stop are not the client's)."""
    if not stopped:
        return len(token_ids)
    lo, hi = 0, len(token_ids)
    while lo < hi:  # the first k whose decoding is at least as long as text
        mid = (lo + hi) // 2
        if len(decode_ids(tokenizer, token_ids[:mid], skip_special=True)) >= len(text):
            hi = mid
        else:
            lo = mid + 1
    return lo


def sampling(body: Mapping[str, Any], defaults: SamplingParams) -> SamplingParams:
    """The sampling of an OpenAI body over ``defaults`` (the server's): ``max_tokens`` (or
    ``max_completion_tokens``), ``temperature``, ``top_p``, ``presence_penalty``,
    ``frequency_penalty``, ``seed``, ``stop`` (OpenAI's names), and ``top_k``, ``min_p``,
    ``repetition_penalty``, ``repetition_context_size`` (``mlx_lm.server``'s). Raises
    :class:`APIError` 400 for a bad value (the ranges are
    :class:`~tierchat.core.sampling_params.SamplingParams`') or an unsupported feature
    (``n`` > 1, ``logprobs``)."""
    if not isinstance(body, Mapping):
        raise APIError("the request body must be a JSON object")
    max_name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    if check_number(body, "n", 1, 1, 128, int) != 1:
        raise APIError("only n=1 is supported", param="n")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise APIError("logprobs are not supported", param="logprobs")
    check_unsupported(body)
    # OpenAI's seeds are any 64-bit integer, taken modulo 2**32 (as before the one record)
    seed = check_number(body, "seed", None, -(1 << 63), (1 << 64) - 1, int)
    stop = body.get("stop")
    values = {
        **{k: body.get(k) for k in OPENAI_SAMPLING},
        "max_tokens": body.get(max_name),
        "stop": [stop] if isinstance(stop, str) else stop,
        "seed": None if seed is None else seed % (1 << 32),
    }
    if values["top_p"] == 0:  # OpenAI's 0 (nothing kept) taken as off, as it always was
        values["top_p"] = 1.0
    return sampling_params(values, defaults, {"max_tokens": max_name})


OPENAI_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "frequency_penalty",
)


def sampling_params(
    values: Mapping[str, Any], defaults: SamplingParams, names: Mapping[str, str] | None = None
) -> SamplingParams:
    """``values`` (a body's fields by :class:`SamplingParams`' names; None: not given) over
    ``defaults``. Raises :class:`APIError` 400 naming the body's field (``names`` maps a
    field to the body's name where they differ: ``max_output_tokens``)."""
    given = {k: v for k, v in values.items() if v is not None}
    try:
        return SamplingParams.from_dict(given, defaults)
    except SamplingError as e:
        name = (names or {}).get(e.field, e.field)
        raise APIError(f"'{name}' {e.problem}", param=name) from None


def stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """``(stream, include_usage)`` of a body (``stream``, ``stream_options``). Raises
    :class:`APIError` 400."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError("'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise APIError("'stream_options' must be an object", param="stream_options")
    return stream, bool(options.get("include_usage"))
