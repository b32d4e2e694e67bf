"""``tierchat bench --workload SCRIPT.jsonl``: a whole chat replayed on tierchat and on
mlx-lm's ``LRUPromptCache``, request by request in turn (docs/DESIGN.md §17).

The script is a replay script (cli/replay.py: ``new`` with a system prompt, ``user``,
``regenerate``, ``edit``, ``swipe``, ``restart``, ``clear``), read and checked by the same
parser (a ``.gz`` file is gunzipped first); every generating op must be greedy (no
``temperature``). ``--workload chat`` and ``--workload chat-ci`` name the scripts shipped
in ``cli/workloads/`` (see its README).

tierchat runs the script as ``tierchat replay`` does (:class:`~tierchat.cli.replay.Replay`:
a :class:`~tierchat.core.chat.session.ChatSession` over the engine and a throwaway store).
Before each generating op the prompt is built once, with the session's own prompt builder,
for the path that op will generate on; mlx-lm gets those token ids, and tierchat's session
must build the same ones (checked; a difference is an error). mlx-lm's side is
:class:`~tierchat.cli.bench.mlx_baseline.LRUBaseline`: ``mlx_lm.server``'s default (batched)
path, with the chat's messages for its segments: caches saved at the end of the system
prompt and of the user segment, and of prompt + reply at the end; 10 entries; on the
engine thread with the engine's model. It sees the same conversation (tierchat's replies
are spliced into later prompts), so where its own reply would differ its trie stops
matching after the previous prompt; ``--baseline server`` (cli/bench/workload_http.py) replays
the workload through both servers over HTTP instead, each with its own replies.

Who goes first alternates from request to request; before each request of either system
the SSD writer has written what earlier requests stored (:func:`~tierchat.cli.bench.main
writer_idle`). A ``restart`` closes tierchat's engine and opens a new one on the same cache
dir (hot tier, tails and resident cache gone; the SSD tier stays; the page cache is not
dropped, as after an app restart) and waits for its start-up verifier; mlx-lm's LRU is
emptied (its server keeps nothing on disk). ``clear`` with tier ``hot`` or ``all`` empties
mlx-lm's LRU too.

No warm-up at the workload's own lengths: users pay for every new prompt shape.
``--warmup unrelated`` first runs both systems once at 96, 480 and 1500 tokens of text
sharing no prefix with the workload (tierchat with its cache off; mlx-lm's LRU is emptied
after).

Each generating op is classified (:func:`op_kinds`): the first generating op after a
``restart`` is "turn after a restart"; else ``regenerate`` and ``edit`` are their own
kinds; a ``user`` op right after an ``edit`` is "turn after the edit", the first
generating op of a conversation "new conversation", any other ``user`` op "next user turn".
Per kind and for all requests: count, prefilled tokens of each system (summed), median,
p90 (nearest rank) and worst TTFT of each, and the ratio of the medians (tierchat /
mlx-lm; < 1: tierchat is faster).
"""

from __future__ import annotations

import gc
import gzip
import io
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tierchat.cli.bench.main import WARMUP_SALT, make_prompt, writer_idle
from tierchat.cli.bench.mlx_baseline import LRUBaseline
from tierchat.cli.bench.workload_report import (  # noqa: F401 -- the report's names, here too
    ALL,
    KINDS,
    MLX_LM,
    MLX_LM_SERVER,
    TIERCHAT,
    format_summary,
    p90,
    ratio_text,
    summarize,
)
from tierchat.cli.common import EXIT_USAGE, CLIError, open_store
from tierchat.cli.replay import (
    GENERATING,
    Op,
    Replay,
    ScriptError,
    parse_script,
    read_script,
    token_ids_sha256,
)
from tierchat.core.sampling_params import SamplingParams

WORKLOADS_DIR = Path(__file__).resolve().parents[1] / "workloads"
NAMED: dict[str, str] = {"chat": "chat.jsonl.gz", "chat-ci": "chat-ci.jsonl"}
WARMUP_LENGTHS: tuple[int, ...] = (96, 480, 1500)  # tokens; see the module doc


# ------------------------------------------------------------------ the script


def workload_path(spec: str) -> Path:
    """The file of ``spec``: a shipped workload's name (:data:`NAMED`) or a path."""
    return WORKLOADS_DIR / NAMED[spec] if spec in NAMED else Path(spec)


def read_workload(spec: str) -> tuple[str, list[Op]]:
    """``(path, ops)`` of a workload: read (gunzipped when it ends in ``.gz``) and checked
    by the replay parser, then every generating op checked to be greedy.

    Raises:
        CLIError: (exit 2) a missing or malformed script, a ``temperature`` field, or no
            generating op.
    """
    path = workload_path(spec)
    if path.suffix == ".gz":  # the shipped chat: 8 copies of its system prompt, gzipped
        try:
            text = gzip.decompress(path.read_bytes()).decode("utf-8")
        except FileNotFoundError:
            raise CLIError(f"{path}: no such file", EXIT_USAGE) from None
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise CLIError(f"{path}: not a gzipped UTF-8 script ({e})", EXIT_USAGE) from None
        try:
            ops = parse_script(text.splitlines(), str(path))
        except ScriptError as e:
            raise CLIError(str(e), EXIT_USAGE) from None
    else:
        ops = read_script(str(path))
    for op in ops:
        if op.args.get("temperature", 0) != 0:
            raise CLIError(
                f'{path}:{op.index + 1}: the workload bench is greedy: drop "temperature"',
                EXIT_USAGE,
            )
    if not any(op.op in GENERATING for op in ops):
        raise CLIError(f"{path}: no generating op (user, regenerate, edit)", EXIT_USAGE)
    return str(path), ops


def op_kinds(ops: Sequence[Op]) -> dict[int, str]:
    """The kind (:data:`KINDS`) of each generating op, by ``op.index`` (rules in the
    module doc)."""
    kinds: dict[int, str] = {}
    turns, after_edit, after_restart = 0, False, False
    for op in ops:
        if op.op == "new":
            turns, after_edit = 0, False
        elif op.op == "restart":
            after_restart = True
        elif op.op in GENERATING:
            if after_restart:
                kind = "turn after a restart"
            elif op.op in ("regenerate", "edit"):
                kind = op.op
            elif after_edit:
                kind = "turn after the edit"
            else:
                kind = "new conversation" if turns == 0 else "next user turn"
            kinds[op.index] = kind
            turns += 1
            after_edit, after_restart = op.op == "edit", False
    return kinds


def next_prompt(session: Any, op: Op):
    """``(prompt, messages)``: the :class:`~tierchat.core.chat.prompts.Prompt` that ``session``
    will submit for the generating ``op`` (built with its own builder, for the path the op
    generates on) and the role/content messages it was built from, without changing the
    conversation.

    Raises:
        SessionError: as the op itself would (no such turn, nothing to regenerate).
    """
    from tierchat.core.chat.session import SessionError

    settings = session.settings()
    if op.op == "regenerate":
        path = session.active_path()
        users = [i for i, n in enumerate(path) if n.role == "user"]
        if not users:
            raise SessionError("nothing to regenerate: no user message on the active path")
        messages = session.prompt_messages(path[: users[-1] + 1], settings)
        return session.build_prompt(messages, settings), messages
    if op.op == "edit":
        turns = session.user_turns()
        turn = op.args["turn"]
        if not 0 <= turn < len(turns):
            raise SessionError(f"no user turn {turn} (the active path has {len(turns)})")
        parent = turns[turn].parent_id
        base = session.store.path_to(parent) if parent is not None else []
    else:
        base = session.active_path()
    messages = session.prompt_messages(base, settings)
    messages.append({"role": "user", "content": op.args["text"], "token_ids": None})
    return session.build_prompt(messages, settings), messages


# ------------------------------------------------------------------ running


@dataclass
class WorkloadResult:
    """What :func:`run_workload` measured: one row per generating op (JSON-ready dicts,
    see :meth:`WorkloadRun.request`), the prompt token ids of each row (same order), the
    model's compute dtype and the seconds the replay took."""

    rows: list[dict] = field(default_factory=list)
    prompts: list[tuple[int, ...]] = field(default_factory=list)
    dtype: str = ""
    wall_s: float = 0.0


class WorkloadRun:
    """One replay of a workload on tierchat and (with ``baseline``) mlx-lm, op by op."""

    def __init__(
        self, settings: Any, store: Any, name: str, baseline: bool, log: Callable[[str], None]
    ) -> None:
        self.settings, self.name, self.log = settings, name, log
        self.replay = Replay(settings, store, name, io.StringIO())
        self.baseline = baseline
        self.lru = LRUBaseline(self.replay.engine, settings.model) if baseline else None
        self.result = WorkloadResult(dtype=self.replay.engine.loaded.dtype)
        self.conversation = 0

    def close(self) -> None:
        self.lru = None
        self.replay.close()

    def warmup(self, lengths: Sequence[int] = WARMUP_LENGTHS) -> None:
        """Both systems once at each of ``lengths`` (tokens), on text sharing no prefix
        with any chat prompt; tierchat with its cache off, mlx-lm's LRU emptied after."""
        from tierchat.core.api import Failed, GenerateRequest

        engine = self.replay.engine
        for i, n in enumerate(lengths):
            prompt = make_prompt(engine.tokenizer, n, salt=WARMUP_SALT - i)
            got = engine.submit(
                GenerateRequest(
                    sampling=SamplingParams(max_tokens=2), prompt_ids=tuple(prompt), use_cache=False
                )
            ).wait()
            if isinstance(got, Failed):
                raise CLIError(f"warm-up failed: {got.message}")
            if self.lru is not None:
                self.lru.generate(prompt, max_tokens=2)
        if self.lru is not None:
            self.lru.clear()

    def run(self, ops: Sequence[Op]) -> WorkloadResult:
        from tierchat.core.chat.session import SessionError

        return replay_ops(
            self,
            ops,
            errors=(SessionError,),
            # the SSD tier failing or turning off
            after_op=lambda: self.replay.ssd_watch.check(sys.stderr),
        )

    def other(self, op: Op) -> None:
        if op.op == "new":
            self.conversation += 1
        if op.op == "restart":
            self.restart()
            return
        self.replay.step(op)
        if op.op == "clear" and op.args["tier"] in ("hot", "all") and self.lru is not None:
            self.lru.clear()

    def restart(self) -> None:
        if self.lru is not None:
            self.lru.clear()
        self.lru = None  # it holds the old engine: drop it before the model loads again
        gc.collect()
        self.replay.restart()
        engine = self.replay.engine
        if engine.cache is not None and engine.cache.ssd is not None:
            engine.cache.ssd.wait_verified()  # its start-up reads are not a request's
        if self.baseline:
            self.lru = LRUBaseline(engine, self.settings.model)

    def request(self, op: Op, kind: str, index: int) -> dict:
        """Run generating ``op`` on both systems (who goes first alternates with
        ``index``); returns its row: op, kind, prompt length and sha256, and per system
        ``cached_tokens``, ``prefill_tokens``, ``ttft_s`` and the generated ``token_ids``;
        ``same_tokens`` when both generated the same ids."""
        session = self.replay.session
        prompt, messages = next_prompt(session, op)
        ids = tuple(prompt.token_ids)
        max_tokens = op.args.get("max_tokens") or session.settings().sampling.max_tokens
        runs = {TIERCHAT: lambda: self._tierchat(op, ids)}
        if self.lru is not None:
            runs[MLX_LM] = lambda: self._mlx_lm(ids, max_tokens, messages)
        order = list(runs) if index % 2 == 0 else list(runs)[::-1]
        got = {}
        for system in order:
            writer_idle(self.replay.engine)  # the writer idle, as between chat turns
            got[system] = runs[system]()
        row = {
            **row_head(op, kind, index, self.conversation),
            "prompt_tokens": len(ids),
            "prompt_sha256": token_ids_sha256(ids),
            "max_tokens": max_tokens,
            "first": order[0],
            **got,
            "same_tokens": (
                got[TIERCHAT]["token_ids"] == got[MLX_LM]["token_ids"] if MLX_LM in got else None
            ),
        }
        self.result.rows.append(row)
        self.result.prompts.append(ids)
        return row

    def _tierchat(self, op: Op, ids: tuple[int, ...]) -> dict:
        errors = self.replay.errors
        err = io.StringIO()
        self.replay.err = err
        self.replay.generate(op)
        if self.replay.errors != errors:
            raise CLIError(err.getvalue().strip().removeprefix("error: ") or "generation failed")
        turn = self.replay.session.current
        if tuple(turn.prompt.token_ids) != ids:
            raise CLIError(
                f"{self.name}:{op.index + 1}: the session built another prompt than the "
                "one given to mlx-lm (a bench bug)"
            )
        line = self.replay.results[-1]
        return {
            "cached_tokens": line["cached_tokens"],
            "prefill_tokens": line["prefill_tokens"],
            "ttft_s": line["ttft_s"],
            "cached_by": line["cached_by"],
            "token_ids": list(turn.reply_node.token_ids or ()),
        }

    def _mlx_lm(self, ids: tuple[int, ...], max_tokens: int, messages: list[dict]) -> dict:
        got = self.lru.generate(list(ids), max_tokens, messages)
        return {
            "cached_tokens": got.counts["cached_tokens"],
            "prefill_tokens": got.counts["prefill_tokens"],
            "ttft_s": round(got.counts["ttft_s"], 6),
            "token_ids": got.tokens,
        }


class OpRunner(Protocol):
    """What :func:`replay_ops` drives: a replay on tierchat and mlx-lm in this process
    (:class:`WorkloadRun`) or through their servers (``workload_http.HttpWorkloadRun``)."""

    name: str
    result: WorkloadResult
    log: Callable[[str], None]

    def request(self, op: Op, kind: str, index: int) -> dict: ...

    def other(self, op: Op) -> None: ...


def replay_ops(
    runner: OpRunner,
    ops: Sequence[Op],
    *,
    errors: tuple[type[Exception], ...],
    systems: Sequence[str] = (TIERCHAT, MLX_LM),
    after_op: Callable[[], None] | None = None,
) -> WorkloadResult:
    """Replay ``ops`` in order on ``runner``: a generating op is a ``request`` (one row,
    its progress line logged with the ``systems`` it shows), any other op goes to
    ``other``; ``after_op`` runs after each. Sets ``runner.result.wall_s`` (seconds) and
    returns the result. Raises :class:`CLIError` naming the workload and op for any of
    ``errors``."""
    kinds = op_kinds(ops)
    t0 = time.perf_counter()
    for op in ops:
        try:
            if op.op in GENERATING:
                row = runner.request(op, kinds[op.index], len(runner.result.rows))
                runner.log(progress_line(row, len(kinds), systems))
            else:
                runner.other(op)
        except errors as e:
            raise CLIError(f"{runner.name}:{op.index + 1}: {op.op}: {e}") from None
        if after_op is not None:
            after_op()
    runner.result.wall_s = time.perf_counter() - t0
    return runner.result


def row_head(op: Op, kind: str, index: int, conversation: int) -> dict:
    """The fields every row of a replay starts with: ``request`` (its index among the
    rows), ``line`` (the op's line in the workload, from 1), ``op``, ``kind`` (from
    :func:`op_kinds`) and ``conversation`` (how many ``new`` ops came before)."""
    return {
        "request": index,
        "line": op.index + 1,
        "op": op.op,
        "kind": kind,
        "conversation": conversation,
    }


def progress_line(row: dict, total: int, systems: Sequence[str] = (TIERCHAT, MLX_LM)) -> str:
    parts = [f"{row['request'] + 1}/{total} {row['kind']} ({row['prompt_tokens']} tokens):"]
    for system in systems:
        if system in row:
            r = row[system]
            parts.append(f"{system} {r['ttft_s']:.4f} s, prefilled {r['prefill_tokens']};")
    return " ".join(parts).rstrip(";")


def run_workload(
    settings: Any,
    ops: Sequence[Op],
    name: str,
    *,
    baseline: bool = True,
    warmup: bool = False,
    log: Callable[[str], None] = lambda text: None,
) -> WorkloadResult:
    """Replay ``ops`` on tierchat (and mlx-lm with ``baseline``) with ``settings`` (its
    cache dir is used as is: give it an empty one), conversations in a throwaway store.
    Raises :class:`CLIError` when a request fails."""
    with tempfile.TemporaryDirectory(prefix="tierchat-workload-") as tmp:
        store = open_store(Path(tmp) / "workload.sqlite")
        try:
            run = WorkloadRun(settings, store, name, baseline, log)
            try:
                if warmup:
                    log(f"warm-up at unrelated lengths {', '.join(map(str, WARMUP_LENGTHS))}")
                    run.warmup()
                return run.run(ops)
            finally:
                run.close()
        finally:
            store.close()
