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
:class:`~tierchat.cli.bench.main.LRUBaseline`: ``fetch_nearest_cache``, ``generate_step``
(``prefill_step_size`` 2048) until ``max_tokens`` or an EOS token, ``insert_cache`` of
prompt + generated tokens, 10 entries, on the engine thread with the engine's model. It
sees the same conversation (tierchat's replies are spliced into later prompts), so a
regenerate or an edit hits or misses in its trie as it would in ``mlx_lm.server``.

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
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierchat.cli.bench.main import (
    WARMUP_SALT,
    LRUBaseline,
    _fresh_cache_dir,
    make_prompt,
    writer_idle,
)
from tierchat.cli.common import EXIT_OK, EXIT_USAGE, CLIError, open_store, table
from tierchat.cli.replay import (
    GENERATING,
    Op,
    Replay,
    ScriptError,
    parse_script,
    read_script,
    token_ids_sha256,
)

WORKLOADS_DIR = Path(__file__).resolve().parents[1] / "workloads"
NAMED: dict[str, str] = {"chat": "chat.jsonl.gz", "chat-ci": "chat-ci.jsonl"}
KINDS: tuple[str, ...] = (
    "new conversation",
    "next user turn",
    "regenerate",
    "edit",
    "turn after the edit",
    "turn after a restart",
)
ALL = "all"
TIERCHAT, MLX_LM = "tierchat", "mlx-lm LRU"
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
    """The :class:`~tierchat.core.chat.prompts.Prompt` that ``session`` will submit for the
    generating ``op`` (built with its own builder, for the path the op generates on),
    without changing the conversation.

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
        return session.build_prompt(path[: users[-1] + 1], settings)
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
    return session.build_prompt(messages, settings)


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
                GenerateRequest(prompt_ids=tuple(prompt), max_tokens=2, use_cache=False)
            ).wait()
            if isinstance(got, Failed):
                raise CLIError(f"warm-up failed: {got.message}")
            if self.lru is not None:
                self.lru.generate(prompt, max_tokens=2)
        if self.lru is not None:
            self.lru.clear()

    def run(self, ops: Sequence[Op]) -> WorkloadResult:
        from tierchat.core.chat.session import SessionError

        kinds = op_kinds(ops)
        total = len(kinds)
        t0 = time.perf_counter()
        for op in ops:
            try:
                if op.op in GENERATING:
                    row = self.request(op, kinds[op.index], len(self.result.rows))
                    self.log(progress_line(row, total))
                else:
                    self.other(op)
            except SessionError as e:
                raise CLIError(f"{self.name}:{op.index + 1}: {op.op}: {e}") from None
            self.replay.ssd_watch.check(sys.stderr)  # the SSD tier failing or turning off
        self.result.wall_s = time.perf_counter() - t0
        return self.result

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
        prompt = next_prompt(session, op)
        ids = tuple(prompt.token_ids)
        max_tokens = op.args.get("max_tokens") or session.settings().max_tokens
        runs = {TIERCHAT: lambda: self._tierchat(op, ids)}
        if self.lru is not None:
            runs[MLX_LM] = lambda: self._mlx_lm(ids, max_tokens)
        order = list(runs) if index % 2 == 0 else list(runs)[::-1]
        got = {}
        for system in order:
            writer_idle(self.replay.engine)  # the writer idle, as between chat turns
            got[system] = runs[system]()
        row = {
            "request": index,
            "line": op.index + 1,
            "op": op.op,
            "kind": kind,
            "conversation": self.conversation,
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

    def _mlx_lm(self, ids: tuple[int, ...], max_tokens: int) -> dict:
        got = self.lru.generate(list(ids), max_tokens)
        return {
            "cached_tokens": got.counts["cached_tokens"],
            "prefill_tokens": got.counts["prefill_tokens"],
            "ttft_s": round(got.counts["ttft_s"], 6),
            "token_ids": got.tokens,
        }


def progress_line(row: dict, total: int) -> str:
    parts = [f"{row['request'] + 1}/{total} {row['kind']} ({row['prompt_tokens']} tokens):"]
    for system in (TIERCHAT, MLX_LM):
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


# ------------------------------------------------------------------ the report


def p90(values: Sequence[float]) -> float:
    """The 90th percentile by nearest rank: the smallest value with at least 90% of the
    values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def summarize(rows: Sequence[dict]) -> list[dict]:
    """One entry per kind present (in :data:`KINDS` order) and one for all requests:
    ``count``, and per system ``prefill_tokens`` (sum), ``ttft_median_s``, ``ttft_p90_s``,
    ``ttft_worst_s``; ``ratio`` = tierchat's median / mlx-lm's (None without mlx-lm)."""
    out = []
    for kind in (*KINDS, ALL):
        got = [r for r in rows if kind in (ALL, r["kind"])]
        if not got:
            continue
        entry: dict[str, Any] = {"kind": kind, "count": len(got)}
        for system in (TIERCHAT, MLX_LM):
            if system not in got[0]:
                continue
            ttfts = [r[system]["ttft_s"] for r in got]
            entry[system] = {
                "prefill_tokens": sum(r[system]["prefill_tokens"] for r in got),
                "ttft_median_s": statistics.median(ttfts),
                "ttft_p90_s": p90(ttfts),
                "ttft_worst_s": max(ttfts),
            }
        base = entry.get(MLX_LM, {}).get("ttft_median_s")
        entry["ratio"] = entry[TIERCHAT]["ttft_median_s"] / base if base else None
        out.append(entry)
    return out


def ratio_text(ratio: float | None) -> str:
    """``0.42x``; three decimals below 0.1 (a regenerate's ratio is often ~0.003)."""
    if ratio is None:
        return "-"
    return f"{ratio:.3f}x" if ratio < 0.1 else f"{ratio:.2f}x"


def format_summary(summary: Sequence[dict]) -> str:
    def cells(entry: dict, system: str) -> tuple:
        s = entry.get(system)
        if s is None:
            return ("-",) * 4
        times = (s["ttft_median_s"], s["ttft_p90_s"], s["ttft_worst_s"])
        return (s["prefill_tokens"], *(f"{t:.4f}" for t in times))

    rows = [
        (
            e["kind"],
            e["count"],
            *cells(e, TIERCHAT),
            *cells(e, MLX_LM),
            ratio_text(e["ratio"]),
        )
        for e in summary
    ]
    headers = ("op", "n", "tc prefilled", "tc median s", "tc p90 s", "tc worst s")
    headers += ("mlx prefilled", "mlx median s", "mlx p90 s", "mlx worst s", "vs mlx-lm")
    return table(rows, headers)


def run_workload_bench(settings: Any, args: Any) -> int:
    """``tierchat bench --workload``: replay the script in a new empty SSD directory inside
    the cache dir (removed at the end), print the per-kind table, write ``--json``."""
    if settings.no_cache:
        raise CLIError("bench measures the cache: drop --no-cache", EXIT_USAGE)
    warmup = getattr(args, "warmup", "none")
    path, ops = read_workload(args.workload)

    def log(text: str) -> None:
        print(f"bench: {text}", file=sys.stderr, flush=True)

    settings.temperature = 0.0  # greedy, whatever the config file says
    with _fresh_cache_dir(Path(settings.cache_dir), log) as tmp:
        settings.cache_dir = tmp
        log(f"workload {path}; model {settings.model}, block size {settings.block_size}")
        result = run_workload(
            settings,
            ops,
            path,
            baseline=not args.no_baseline,
            warmup=warmup == "unrelated",
            log=log,
        )
    from tierchat.core.engine.device import describe_device, device_info

    summary = summarize(result.rows)
    device = describe_device(result.dtype)
    same = [r["same_tokens"] for r in result.rows if r["same_tokens"] is not None]
    print(f"model {settings.model} · block size {settings.block_size} · {device}")
    print(f"workload {path}: {len(result.rows)} requests; warm-up: {warmup}")
    print(format_summary(summary))
    note = f"({result.wall_s:.1f} s; tc = tierchat, mlx = mlx-lm LRUPromptCache; "
    note += "vs mlx-lm = tierchat median TTFT / mlx-lm median TTFT"
    if same:
        note += f"; same reply tokens in {sum(same)} of {len(same)} requests"
    print(note + ")")
    if args.json_out:
        doc = {
            "model": settings.model,
            "block_size": settings.block_size,
            "prefill_chunk": settings.prefill_chunk,
            "device": device,
            "device_info": device_info(result.dtype)._asdict(),
            "workload": path,
            "warmup": warmup,
            "warmup_lengths": list(WARMUP_LENGTHS) if warmup == "unrelated" else [],
            "wall_s": result.wall_s,
            "summary": summary,
            "rows": result.rows,
        }
        try:
            Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            raise CLIError(f"cannot write {args.json_out}: {e.strerror or e}") from None
    return EXIT_OK
