"""``tierchat replay SCRIPT.jsonl``: a scripted session (docs/DESIGN.md §14, a public contract).

Input: one JSON object per line (blank lines are skipped)::

    {"op": "new", "system": "optional system prompt"}
    {"op": "user", "text": "...", "max_tokens": 64}
    {"op": "regenerate", "max_tokens": 64}
    {"op": "edit", "turn": 0, "text": "...", "max_tokens": 64}
    {"op": "swipe", "turn": 0, "index": 0}
    {"op": "restart"}
    {"op": "clear", "tier": "hot" | "ssd" | "tails" | "all"}

``user``, ``regenerate`` and ``edit`` also take ``"temperature"`` (greedy without it,
seeded by ``--seed``). Unknown ops and unknown or mistyped fields are errors: the whole
script is checked before anything runs, and the first bad line is reported as
``error: SCRIPT:LINE: what is wrong`` (exit 2).

Output: one JSON object per generating op with exactly :data:`RESULT_FIELDS`, where
``op_index`` is the op's 0-based line number in the script and ``token_ids_sha256`` is the
sha256 hex digest of the generated token ids written as ASCII decimals joined by commas
(``"12,7,99"``; the empty string for no tokens). Then one ``{"summary": {...}}`` line.

An op that fails (a ``Failed`` event: a refused prefill, an engine error; or an
impossible ``edit``/``swipe``/``regenerate``) prints ``{"op_index", "op", "error"}`` on
stdout and ``error: SCRIPT:LINE: ...`` on stderr; the script goes on and the exit code
is 1 at the end. When a ``new`` fails (a locked or full store), the ops of its
conversation up to the next ``new`` (``user``, ``regenerate``, ``edit``, ``swipe``) are
not run, each reported so (``skipped: ...``); ``restart`` and ``clear`` still run.

``restart`` closes the engine (flushing the SSD writer) and starts a new one: the hot tier,
tails and checkpoints are gone, the SSD tier and the conversation store stay.
Conversations go to a throwaway SQLite file unless ``--data-dir`` is given.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tierchat.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CLIError,
    SSDWatch,
    check_cache_owner,
    new_session,
    open_store,
    start_engine,
)
from tierchat.core.api import CACHE_KINDS, CACHE_SOURCES, CACHE_TIERS, plain
from tierchat.core.live_status import StatusService

# the ops that act on the conversation the last ``new`` opened
CONVERSATION_OPS = frozenset({"user", "regenerate", "edit", "swipe"})
RESULT_FIELDS: tuple[str, ...] = (
    "op_index",
    "op",
    "prompt_tokens",
    "cached_tokens",
    "cached_by",
    "cached_kind",
    "prefill_tokens",
    "ttft_s",
    "prefill_tps",
    "generation_tokens",
    "generation_tps",
    "peak_memory_bytes",
    "text",
    "token_ids_sha256",
)
GENERATING = ("user", "regenerate", "edit")


class ScriptError(ValueError):
    """A malformed script; the message is ``SCRIPT:LINE: what is wrong``."""


# ------------------------------------------------------------------ parsing


def _str(v: Any) -> str | None:
    if not isinstance(v, str):
        return "must be a string"
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON "\ud800": a lone surrogate
        return f"is not valid Unicode (lone surrogate U+{ord(v[e.start]):04X} at {e.start})"
    return None


def _pos_int(v: Any) -> str | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and v > 0
    return None if ok else "must be a positive integer"


def _turn(v: Any) -> str | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
    return None if ok else "must be a non-negative integer"


def _int(v: Any) -> str | None:
    ok = isinstance(v, int) and not isinstance(v, bool)
    return None if ok else "must be an integer"


def _temperature(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 100
    return None if ok else "must be a number >= 0"


def _tier(v: Any) -> str | None:
    return None if v in CACHE_TIERS else f"must be one of {', '.join(CACHE_TIERS)}"


_GEN = {"max_tokens": (False, _pos_int), "temperature": (False, _temperature)}
# op -> field -> (required, check)
OPS: dict[str, dict[str, tuple[bool, Callable[[Any], str | None]]]] = {
    "new": {"system": (False, _str)},
    "user": {"text": (True, _str), **_GEN},
    "regenerate": dict(_GEN),
    "edit": {"turn": (True, _turn), "text": (True, _str), **_GEN},
    "swipe": {"turn": (True, _turn), "index": (True, _int)},
    "restart": {},
    "clear": {"tier": (True, _tier)},
}


@dataclass(frozen=True)
class Op:
    """One script line: ``index`` is its 0-based line number, ``args`` its other fields."""

    index: int
    op: str
    args: dict[str, Any]


def parse_line(text: str) -> tuple[str, dict[str, Any]]:
    """``(op, fields)`` of one script line. Raises ``ValueError`` saying what is wrong."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    op = obj.pop("op", None)
    if op is None:
        raise ValueError('missing "op"')
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}: expected one of {', '.join(OPS)}")
    fields = OPS[op]
    for key in obj:
        if key not in fields:
            allowed = ", ".join(fields) or "none"
            raise ValueError(f'unknown field "{key}" for op {op!r} (allowed: {allowed})')
    for key, (required, check) in fields.items():
        if key not in obj:
            if required:
                raise ValueError(f'op {op!r} needs "{key}"')
            continue
        problem = check(obj[key])
        if problem:
            raise ValueError(f'"{key}" {problem}, got {json.dumps(obj[key])}')
    return op, obj


def parse_script(lines: Sequence[str], name: str) -> list[Op]:
    """Every op of a script; raises :class:`ScriptError` naming the first bad line (1-based)."""
    ops = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            op, args = parse_line(line)
        except ValueError as e:
            raise ScriptError(f"{name}:{i + 1}: {e}") from None
        ops.append(Op(i, op, args))
    return ops


def _decode_lines(data: bytes, name: str) -> list[str]:
    """The script's lines; raises :class:`ScriptError` at the first line that is not
    UTF-8 (``SCRIPT:LINE: ...``)."""
    lines = []
    for i, raw in enumerate(data.split(b"\n")):
        try:
            lines.append(raw.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as e:
            raise ScriptError(
                f"{name}:{i + 1}: not valid UTF-8 ({e.reason} at byte {e.start})"
            ) from None
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def read_script(path: str) -> list[Op]:
    """Read and parse ``path`` (``-``: stdin). Raises :class:`CLIError` (exit 2)."""
    try:
        if path == "-":
            stdin = getattr(sys.stdin, "buffer", None)  # a StringIO (tests) has none
            data = (
                stdin.read()
                if stdin is not None
                else sys.stdin.read().encode("utf-8", "surrogatepass")
            )
            name = "<stdin>"
        else:
            data, name = Path(path).read_bytes(), path
        lines = _decode_lines(data, name)
    except FileNotFoundError:
        raise CLIError(f"{path}: no such file", EXIT_USAGE) from None
    except IsADirectoryError:
        raise CLIError(f"{path}: is a directory", EXIT_USAGE) from None
    except ScriptError as e:
        raise CLIError(str(e), EXIT_USAGE) from None
    except OSError as e:
        raise CLIError(f"{path}: {e.strerror or e}", EXIT_USAGE) from None
    try:
        return parse_script(lines, name)
    except ScriptError as e:
        raise CLIError(str(e), EXIT_USAGE) from None


# ------------------------------------------------------------------ running


def token_ids_sha256(ids: Sequence[int]) -> str:
    """sha256 hex of the ids as ASCII decimals joined by commas (see the module doc)."""
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode("ascii")).hexdigest()


def result_line(op: Op, event: Any) -> dict[str, Any]:
    """The output object of a finished generating op (exactly :data:`RESULT_FIELDS`)."""
    m = event.metrics
    cached_by = {k: int(m.cached_by.get(k, 0)) for k in CACHE_SOURCES}
    cached_kind = {k: int(m.cached_kind.get(k, 0)) for k in CACHE_KINDS}
    return {
        "op_index": op.index,
        "op": op.op,
        "prompt_tokens": m.prompt_tokens,
        "cached_tokens": m.cached_tokens,
        "cached_by": cached_by,
        "cached_kind": cached_kind,
        "prefill_tokens": m.prefill_tokens,
        "ttft_s": round(m.ttft_s, 6),
        "prefill_tps": round(m.prefill_tps, 2),
        "generation_tokens": m.generation_tokens,
        "generation_tps": round(m.generation_tps, 2),
        "peak_memory_bytes": m.peak_memory_bytes,
        "text": event.text,
        "token_ids_sha256": token_ids_sha256(event.token_ids),
    }


class Replay:
    """Runs parsed ops against an engine + store, writing JSON lines to ``out``."""

    def __init__(
        self, settings: Any, store: Any, name: str, out: TextIO, err: TextIO | None = None
    ) -> None:

        self.settings = settings
        self.store = store
        self.name = name
        self.out = out
        self.err = err or sys.stderr
        check_cache_owner(settings)
        self.engine = start_engine(settings)
        self.session = new_session(self.engine, store, settings, swipes=False)
        self.ssd_watch = SSDWatch(self.engine)
        # `tierchat cache stats|clear` in another shell talk to the current engine
        self.status = StatusService(self.engine, settings.cache_dir, "replay").start()
        self.results: list[dict[str, Any]] = []
        self.errors = 0
        self.restarts = 0

    def close(self) -> None:
        self.status.stop()
        if self.engine is not None:  # None after a restart whose model load failed
            self.engine.close()

    def _emit(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.out.flush()

    def _fail(self, op: Op, message: str) -> None:
        self.errors += 1
        self._emit({"op_index": op.index, "op": op.op, "error": message})
        print(f"error: {self.name}:{op.index + 1}: {op.op}: {message}", file=self.err, flush=True)

    def run(self, ops: Sequence[Op]) -> int:
        from tierchat.core.chat.session import SessionError
        from tierchat.core.chat.sqlite import StoreError

        failed_new: Op | None = None  # a failed `new`: its conversation's ops are skipped
        for op in ops:
            if op.op == "new":
                failed_new = None
            elif failed_new is not None and op.op in CONVERSATION_OPS:
                # run elsewhere, they would answer without the script's system prompt
                line = failed_new.index + 1
                self._fail(op, f"skipped: the new conversation of line {line} was not created")
                continue
            try:
                self.step(op)
            except StoreError as e:  # only this op's turn is lost
                self._fail(op, f"not saved: {e}")
                failed_new = op if op.op == "new" else failed_new
            except SessionError as e:
                self._fail(op, str(e))
                failed_new = op if op.op == "new" else failed_new
            if self.engine is not None:
                self.ssd_watch.check(self.err)
        self._emit({"summary": self.summary(len(ops))})
        return EXIT_FAILED if self.errors else EXIT_OK

    def step(self, op: Op) -> None:
        a, s = op.args, self.session
        if op.op == "new":
            s.new_conversation(system=a.get("system") or None)
        elif op.op == "swipe":
            s.swipe(a["turn"], a["index"])
        elif op.op == "clear":
            self.engine.clear(a["tier"])
        elif op.op == "restart":
            self.restart()
        else:
            self.generate(op)

    def restart(self) -> None:

        old = self.session
        self.status.engine = None
        self.engine.close()
        # drop every reference to the old engine (and its model) before loading again,
        # so two copies of the weights never live at once
        old.engine = self.engine = self.session = None
        gc.collect()
        self.engine = start_engine(self.settings, quiet=True)
        self.session = new_session(self.engine, self.store, self.settings, swipes=False)
        self.session.conversation_id = old.conversation_id
        self.ssd_watch = SSDWatch(self.engine)
        self.status.engine = self.engine
        self.restarts += 1

    def generate(self, op: Op) -> None:
        from tierchat.core.api import Failed

        a, s = op.args, self.session
        defaults = s.defaults
        if "temperature" in a:
            sampling = dataclasses.replace(defaults.sampling, temperature=float(a["temperature"]))
            s.defaults = dataclasses.replace(defaults, sampling=sampling)
        try:
            n = a.get("max_tokens")
            if op.op == "user":
                turn = s.send(a["text"], max_tokens=n)
            elif op.op == "regenerate":
                turn = s.regenerate(max_tokens=n)
            else:
                turn = s.edit(a["turn"], a["text"], max_tokens=n)
        finally:
            s.defaults = defaults
        try:
            event = turn.wait()
        except KeyboardInterrupt:
            turn.cancel()
            turn.wait(60)
            raise
        if isinstance(event, Failed):
            kind = "" if event.kind == "error" else f"{event.kind}: "
            self._fail(op, kind + event.message)
            return
        if turn.error is not None:
            self._fail(op, f"reply not stored: {turn.error}")
            return
        line = result_line(op, event)
        self.results.append(line)
        self._emit(line)

    def summary(self, n_ops: int) -> dict[str, Any]:
        r = self.results
        ttfts = [x["ttft_s"] for x in r]
        cached_by = {k: sum(x["cached_by"][k] for x in r) for k in CACHE_SOURCES}
        cached_kind = {k: sum(x["cached_kind"][k] for x in r) for k in CACHE_KINDS}
        stats = plain(self.engine.stats())
        stats.pop("events", None)
        return {
            "model": self.settings.model,
            "ops": n_ops,
            "generations": len(r),
            "errors": self.errors,
            "restarts": self.restarts,
            "prompt_tokens": sum(x["prompt_tokens"] for x in r),
            "cached_tokens": sum(x["cached_tokens"] for x in r),
            "cached_by": cached_by,
            "cached_kind": cached_kind,
            "prefill_tokens": sum(x["prefill_tokens"] for x in r),
            "generation_tokens": sum(x["generation_tokens"] for x in r),
            "ttft_s_mean": round(statistics.fmean(ttfts), 6) if ttfts else 0.0,
            "ttft_s_median": round(statistics.median(ttfts), 6) if ttfts else 0.0,
            "cache": stats,
        }


def run_replay(settings: Any, script: str, *, data_dir_given: bool = False) -> int:
    """``tierchat replay``: parse the whole script, then run it. Returns the exit code."""
    return run_script(Replay, settings, script, data_dir_given=data_dir_given)


def run_script(kind: type[Replay], settings: Any, script: str, *, data_dir_given: bool) -> int:
    """Parse the whole ``script`` (a path, or "-" for stdin), then run it with a ``kind``
    (:class:`Replay` or a subclass) over the data dir's store when ``data_dir_given``, else
    a store in a temporary folder. Returns the exit code."""
    ops = read_script(script)
    name = "<stdin>" if script == "-" else script
    with tempfile.TemporaryDirectory(prefix="tierchat-replay-") as tmp:
        db = settings.db_path if data_dir_given else Path(tmp) / "replay.sqlite"
        store = open_store(db, settings.store_busy_s)
        try:
            replay = kind(settings, store, name, sys.stdout)
            try:
                return replay.run(ops)
            finally:
                replay.close()
        finally:
            store.close()
