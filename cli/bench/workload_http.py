"""``tierchat bench --workload SCRIPT --baseline server``: the workload replayed through
``tierchat serve`` and ``mlx_lm.server`` over HTTP, each answering with its own replies
(docs/DESIGN.md §17).

Each system has its own client (:class:`Conversation`): a chat app's tree of messages,
which sends the active path as text, as any OpenAI client does, and keeps the reply the
server streamed back. ``user`` appends a turn, ``regenerate`` asks again for the last user
turn (a new reply beside the old), ``edit`` replaces user turn ``turn`` (a new branch),
``swipe`` selects another reply, ``new`` starts a conversation. Every request is streamed,
greedy, with the op's ``max_tokens`` (else the settings'); the row keeps what the client
sees: ``usage.prompt_tokens``, ``prompt_tokens_details.cached_tokens``, prefilled = prompt −
cached, TTFT (request sent to the first streamed content) and the reply text.

Both servers run for the whole replay, on the same model directory and 127.0.0.1:
tierchat in this process on a thread (:class:`~tierchat.cli.bench.serve.Ours`, a fresh
SSD directory), mlx-lm as shipped (``python -m mlx_lm server``, its defaults: the batched
path). Who goes first alternates from request to request, as in the in-process bench
(cli/bench/workload.py), because a GPU's speed drifts over minutes; the other server idles
meanwhile. Before each tierchat request its SSD writer has written what earlier requests
stored (as between the turns of a chat). ``restart`` stops both servers and starts them
again (tierchat's SSD tier and reply memory stay; it waits for its start-up verifier);
``clear`` of ``hot`` or ``all`` restarts mlx-lm (it has no other way to empty its cache)
and clears tierchat's tier. ``--warmup unrelated``: each server first answers one request
at each of 96, 480 and 1500 tokens of text sharing no prefix with the workload (they stay
in both caches: unrelated, evicted like any entry).

The report is :mod:`tierchat.cli.bench.workload_report`'s per-kind table, the baseline named
``mlx_lm.server``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierchat.cli.bench.main import WARMUP_SALT, make_prompt, writer_idle
from tierchat.cli.bench.serve import MlxLm, Ours, chat
from tierchat.cli.bench.workload import WARMUP_LENGTHS, WorkloadResult, replay_ops, row_head
from tierchat.cli.bench.workload_report import MLX_LM_SERVER, TIERCHAT
from tierchat.cli.common import CLIError
from tierchat.cli.replay import Op


@dataclass(eq=False)
class Node:
    """One message of a client's conversation tree; ``active`` is the child on the
    path the client shows."""

    role: str
    content: str
    parent: Node | None
    children: list[Node] = field(default_factory=list)
    active: Node | None = None


class Conversation:
    """One conversation as a chat client keeps it (module doc). Raises :class:`ValueError`
    for an op it cannot apply (no such turn, nothing to regenerate)."""

    def __init__(self, system: str | None) -> None:
        self.root = Node("root", "", None)
        if system:
            self._add(self.root, "system", system)

    @staticmethod
    def _add(parent: Node, role: str, content: str) -> Node:
        node = Node(role, content, parent)
        parent.children.append(node)
        parent.active = node
        return node

    def path(self) -> list[Node]:
        out, node = [], self.root.active
        while node is not None:
            out.append(node)
            node = node.active
        return out

    def _user(self, turn: int) -> Node:
        users = [n for n in self.path() if n.role == "user"]
        if not 0 <= turn < len(users):
            raise ValueError(f"no user turn {turn} (the active path has {len(users)})")
        return users[turn]

    @staticmethod
    def messages(nodes: Sequence[Node]) -> list[dict]:
        return [{"role": n.role, "content": n.content} for n in nodes]

    def request(self, op: Op) -> tuple[list[dict], Callable[[str], None]]:
        """The messages to send for generating ``op`` and the function that stores the
        reply where the op puts it."""
        path = self.path()
        if op.op == "regenerate":
            users = [i for i, n in enumerate(path) if n.role == "user"]
            if not users:
                raise ValueError("nothing to regenerate: no user message on the active path")
            user = path[users[-1]]
            return self.messages(path[: users[-1] + 1]), lambda r: self._add(user, "assistant", r)
        text = op.args["text"]
        if op.op == "edit":
            parent = self._user(op.args["turn"]).parent
            before = path[: path.index(parent) + 1] if parent is not self.root else []
        else:
            parent = path[-1] if path else self.root
            before = path

        def commit(reply: str) -> None:
            self._add(self._add(parent, "user", text), "assistant", reply)

        return self.messages(before) + [{"role": "user", "content": text}], commit

    def swipe(self, turn: int, index: int) -> None:
        user = self._user(turn)
        replies = [n for n in user.children if n.role == "assistant"]
        if not -len(replies) <= index < len(replies):
            raise ValueError(f"user turn {turn} has no reply {index} ({len(replies)} replies)")
        user.active = replies[index]


class Server:
    """One server of the replay: how to start and stop it, its handle and its client."""

    def __init__(self, name: str, start, stop, port_of) -> None:
        self.name, self._start, self._stop, self._port_of = name, start, stop, port_of
        self.handle: Any = None
        self.conversation = Conversation(None)

    def start(self) -> None:
        self.handle = self._start()

    def stop(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self._stop(handle)

    @property
    def engine(self) -> Any:
        """tierchat's engine (None for mlx-lm)."""
        return self.handle[0] if self.name == TIERCHAT else None

    def ready(self) -> None:
        """tierchat: the SSD writer idle, as between the turns of a chat."""
        if self.engine is not None:
            writer_idle(self.engine)

    def ask(self, messages: list[dict], max_tokens: int) -> dict:
        self.ready()
        text, usage, ttft = chat(self._port_of(self.handle), messages, max_tokens)
        prompt = usage["prompt_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "prefill_tokens": prompt - cached,
            "ttft_s": round(ttft, 6),
            "completion_tokens": usage.get("completion_tokens", 0),
            "cached_by": (usage.get("tierchat") or {}).get("cached_by", {}),
            "text": text,
        }


class HttpWorkloadRun:
    """One replay of a workload through both servers, op by op (module doc)."""

    def __init__(self, servers: list[Server], max_tokens: int, name: str, log) -> None:
        self.servers, self.max_tokens, self.name, self.log = servers, max_tokens, name, log
        self.result = WorkloadResult()
        self.conversation = 0

    def warmup(self, tokenizer: Any) -> None:
        for i, n in enumerate(WARMUP_LENGTHS):
            text = tokenizer.decode(make_prompt(tokenizer, n, salt=WARMUP_SALT - i))
            for server in self.servers:
                server.ask([{"role": "user", "content": text}], 2)

    def restart(self, which: Sequence[Server]) -> None:
        for server in which:
            server.stop()
        for server in which:
            server.start()
            engine = server.engine
            if engine is not None and engine.cache is not None and engine.cache.ssd is not None:
                engine.cache.ssd.wait_verified()  # its start-up reads are not a request's

    def run(self, ops: Sequence[Op]) -> WorkloadResult:
        return replay_ops(self, ops, errors=(ValueError,), systems=(TIERCHAT, MLX_LM_SERVER))

    def other(self, op: Op) -> None:
        if op.op == "new":
            self.conversation += 1
            for server in self.servers:
                server.conversation = Conversation(op.args.get("system") or None)
        elif op.op == "swipe":
            for server in self.servers:
                server.conversation.swipe(op.args["turn"], op.args["index"])
        elif op.op == "restart":
            self.restart(self.servers)
        elif op.op == "clear":
            tier = op.args["tier"]
            for server in self.servers:
                if server.engine is not None:
                    server.engine.clear(tier)
            if tier in ("hot", "all"):
                self.restart([s for s in self.servers if s.engine is None])

    def request(self, op: Op, kind: str, index: int) -> dict:
        max_tokens = op.args.get("max_tokens") or self.max_tokens
        order = self.servers if index % 2 == 0 else self.servers[::-1]
        got = {}
        for server in order:
            messages, commit = server.conversation.request(op)
            got[server.name] = server.ask(messages, max_tokens)
            commit(got[server.name]["text"])
        texts = {r["text"] for r in got.values()}
        row = {
            **row_head(op, kind, index, self.conversation),
            "prompt_tokens": got[TIERCHAT]["prompt_tokens"],
            "max_tokens": max_tokens,
            "first": order[0].name,
            **got,
            "same_text": len(texts) == 1 if len(got) > 1 else None,
        }
        self.result.rows.append(row)
        return row


def run_http_workload(
    settings: Any,
    ops: Sequence[Op],
    name: str,
    tmp: Path,
    *,
    baseline: bool = True,
    warmup: bool = False,
    log: Callable[[str], None] = lambda text: None,
) -> WorkloadResult:
    """Replay ``ops`` through tierchat serve (``settings``; its cache dir is used as is:
    give it an empty one) and, with ``baseline``, mlx_lm.server, both on 127.0.0.1;
    ``tmp`` holds tierchat's data dir and mlx-lm's log. Raises :class:`CLIError` when a
    request fails or the script does what a client cannot (with the mlx-lm log's tail)."""
    import dataclasses

    from tierchat.cli.bench.shape_export import mlx_model_dir

    ours = Ours(dataclasses.replace(settings, data_dir=tmp / "data", no_cache=False))
    servers = [Server(TIERCHAT, ours.start, ours.stop, ours.port)]
    log_file = tmp / "mlx_lm_server.log"
    if baseline:
        model_dir = mlx_model_dir(settings.model, settings.models_dir)
        mlx = MlxLm(model_dir, settings.sampling.max_tokens, log_file)
        servers.append(Server(MLX_LM_SERVER, mlx.start, mlx.stop, mlx.port))
    run = HttpWorkloadRun(servers, settings.sampling.max_tokens, name, log)
    try:
        for server in servers:
            server.start()
        engine = servers[0].engine
        run.result.dtype = engine.loaded.dtype
        if warmup:
            log(f"warm-up at unrelated lengths {', '.join(map(str, WARMUP_LENGTHS))}")
            run.warmup(engine.tokenizer)
        return run.run(ops)
    except CLIError as e:
        tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
        raise CLIError(f"{e.message}\n{tail}".rstrip(), e.code) from None
    finally:
        for server in servers:
            server.stop()
