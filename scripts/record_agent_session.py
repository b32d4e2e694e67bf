"""A scripted stand-in for an LLM server that records what agent CLIs send it.

It speaks the three wires the agent CLIs use, streaming only where the client asks:

- ``POST /v1/messages`` (Anthropic Messages; Claude Code adds ``?beta=true``): SSE
  ``message_start``, ``content_block_start`` / ``content_block_delta`` (``text_delta``,
  ``input_json_delta``) / ``content_block_stop``, ``message_delta`` (``stop_reason``),
  ``message_stop``;
- ``POST /v1/responses`` (OpenAI Responses; Codex CLI): ``response.created``,
  ``response.output_item.added``, ``response.output_text.delta`` or
  ``response.function_call_arguments.delta``, ``response.output_item.done``,
  ``response.completed``, each with a ``sequence_number``;
- ``POST /v1/chat/completions`` (OpenAI chat; OpenCode): chunks with ``delta.tool_calls``
  and ``finish_reason: "tool_calls"``, a usage chunk when ``stream_options.include_usage``;
- ``GET /v1/models``.

A *main* request (one that offers ``tools``) is answered with the next step of a fixed
script: the step is the number of tool calls already in the request's conversation, so
retries and side requests do not move it. Each step is one tool call (read a file, run a
shell command), mapped onto the tool names and argument names of the CLI that asked; after
the last step the answer is text that quotes the last tool result (so a test can see that
the CLI really ran its tool and sent the output back). A request without tools (a title,
a summary) gets a short fixed text.

Usage is invented but consistent: tokens are characters / 4 of the request's system,
tools and conversation, serialized in that order, and the cached part is the common prefix
with the previous main request's, so a client-side check of cached tokens can be tried here.

Every request is written as one JSON line to ``--out``: ``{"api", "path", "headers", "body"}``
(``api``: ``messages``, ``responses`` or ``chat``; ``headers``: the few that say which
client and version sent it).

    python scripts/record_agent_session.py serve --out /tmp/log.jsonl --workdir DIR [--script tour]
    python scripts/record_agent_session.py record claude-code|codex|opencode|all [--script read-large]

``serve`` prints ``recording on http://127.0.0.1:PORT/v1`` on stderr once it listens.
``record`` makes a scratch project (a small Python package), installs the CLIs (tests/
agent_kit.py), runs one CLI against this server with the ``tour`` script and writes
``cli/workloads/agent-<name>.jsonl`` (``.jsonl.gz`` over 1 MB), with the scratch paths
replaced by ``/home/user`` and ``/home/user/project``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

Api = Literal["messages", "responses", "chat"]
StepKind = Literal["read", "shell"]

ROOT = Path(__file__).resolve().parents[1]
KEPT_HEADERS = (
    "user-agent",
    "anthropic-version",
    "anthropic-beta",
    "x-app",
    "originator",
    "openai-beta",
    "session_id",
    "version",
)
SIDE_TEXT = "Reviewing a small Python project"


@dataclass(frozen=True)
class Step:
    """One scripted tool call: ``read`` a file (relative to the work dir) or run ``shell``."""

    kind: StepKind
    arg: str


SCRIPTS: dict[str, list[Step]] = {
    "notes": [Step("read", "notes.txt")],
    "tour": [
        Step("shell", "ls -R"),
        Step("read", "README.md"),
        Step("read", "shapes/geometry.py"),
        Step("shell", "grep -rn 'def ' shapes"),
        Step("read", "shapes/units.py"),
        Step("read", "tests/test_geometry.py"),
        Step("shell", "wc -l shapes/*.py tests/*.py"),
        Step("read", "pyproject.toml"),
    ],
}
# the long session (``record claude-code --script read-large``): this repository's largest
# source files, copied into the scratch project under their own paths and read one by one,
# so the prompt grows by ~7K tokens a step, past 64K tokens after the ninth and to ~120K
LARGE_FILES = (
    "core/cache/prefix.py",
    "core/engine/engine.py",
    "tui/screens/chat/pane.py",
    "core/cache/ssd/tier.py",
    "core/chat/store.py",
    "core/chat/session.py",
    "core/chat/prompts.py",
    "core/engine/scheduler.py",
    "core/serve/anthropic_api.py",
    "cli/bench/main.py",
    "cli/bench/agent_bench.py",
    "core/engine/executor.py",
    "tui/widgets/transcript.py",
    "tui/widgets/cache_panels.py",
    "core/chat/tool_calls.py",
)
# then the small steps an agent takes once it has read them (a count, a search, a listing:
# a few hundred tokens each), so the session's last requests reuse ~99% of their prompt, as
# an agent's requests after a restart of the server do
FOLLOW_UPS = (
    "wc -l " + " ".join(LARGE_FILES),
    "grep -c 'def ' " + " ".join(LARGE_FILES),
    "grep -n '^class ' core/cache/prefix.py core/cache/ssd/tier.py",
    "ls core/cache core/cache/ssd",
)
SCRIPTS["read-large"] = [
    Step("shell", "ls -R"),
    *(Step("read", f) for f in LARGE_FILES),
    *(Step("shell", c) for c in FOLLOW_UPS),
]


# ---------------------------------------------------------------- the request's view


def api_of(path: str) -> Api | None:
    p = urlsplit(path).path.rstrip("/")
    return {
        "/v1/messages": "messages",
        "/v1/responses": "responses",
        "/v1/chat/completions": "chat",
    }.get(p)


def conversation(api: Api, body: dict[str, Any]) -> list[Any]:
    return list(body.get("input") if api == "responses" else body.get("messages") or [])


def tool_calls_so_far(api: Api, body: dict[str, Any]) -> int:
    n = 0
    for item in conversation(api, body):
        if not isinstance(item, dict):
            continue
        if api == "responses":
            n += item.get("type") == "function_call"
        elif api == "chat":
            n += len(item.get("tool_calls") or []) if item.get("role") == "assistant" else 0
        elif item.get("role") == "assistant" and isinstance(item.get("content"), list):
            n += sum(1 for b in item["content"] if b.get("type") == "tool_use")
    return n


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            _text(c.get("text", c.get("content", ""))) for c in content if isinstance(c, dict)
        )
    return ""


def last_tool_result(api: Api, body: dict[str, Any]) -> str:
    found = ""
    for item in conversation(api, body):
        if not isinstance(item, dict):
            continue
        if api == "responses" and item.get("type") == "function_call_output":
            found = _text(item.get("output"))
        elif api == "chat" and item.get("role") == "tool":
            found = _text(item.get("content"))
        elif api == "messages" and isinstance(item.get("content"), list):
            for b in item["content"]:
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    found = _text(b.get("content"))
    return found


def _normal(value: Any) -> Any:
    """The value as a chat template would see it: without ``cache_control`` marks (Claude
    Code moves them every turn) and with a list of text blocks as one string (Claude Code
    sends its first turn's system message as blocks, later ones as a string)."""
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        if value and all(
            isinstance(v, dict)
            and set(v) <= {"type", "text", "cache_control"}
            and v.get("type") == "text"
            for v in value
        ):
            return "".join(v["text"] for v in value)
        return [_normal(v) for v in value]
    return value


def prompt_text(api: Api, body: dict[str, Any]) -> str:
    head = body.get("instructions") if api == "responses" else body.get("system")
    text = json.dumps(_normal([head, body.get("tools"), conversation(api, body)]))
    return text[:-2]  # open at the end: the next turn's prompt extends it


# ---------------------------------------------------------------- the scripted answer


def tool_call(api: Api, tools: list[dict[str, Any]], step: Step, workdir: Path) -> tuple[str, dict]:
    """(tool name, arguments) for ``step`` in the CLI's own tools, judged by their names."""
    names = {(t.get("name") or t.get("function", {}).get("name") or "") for t in tools}
    if step.kind == "read" and "Read" in names:
        return "Read", {"file_path": str(workdir / step.arg)}
    if step.kind == "read" and "read" in names:
        return "read", {"filePath": str(workdir / step.arg)}
    command = f"cat {step.arg}" if step.kind == "read" else step.arg
    if "Bash" in names:
        return "Bash", {"command": command, "description": f"Run {command}"}
    if "bash" in names:
        return "bash", {"command": command, "description": f"Run {command}"}
    if "exec_command" in names:
        return "exec_command", {"cmd": command}
    if "shell" in names:
        return "shell", {"command": ["bash", "-lc", command]}
    raise ValueError(f"no read or shell tool among {sorted(names)}")


@dataclass(frozen=True)
class Answer:
    text: str = ""
    tool: str = ""
    arguments: str = ""  # JSON


class Recorder:
    """The script, the log file and the previous main prompt (for the invented usage)."""

    def __init__(self, out: Path, workdir: Path, script: list[Step]) -> None:
        self.out, self.workdir, self.script = out, workdir, script
        self.lock = threading.Lock()
        self.previous_main = ""
        self.count = 0

    def record(self, api: Api | None, path: str, headers: dict[str, str], body: Any) -> None:
        line = {"api": api, "path": path, "headers": headers, "body": body}
        with self.lock, self.out.open("a") as f:
            f.write(json.dumps(line) + "\n")
            self.count += 1

    def answer(self, api: Api, body: dict[str, Any]) -> tuple[Answer, dict[str, int]]:
        tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
        text = prompt_text(api, body)
        prompt = len(text) // 4
        cached = 0
        if tools:
            with self.lock:
                n = len(os.path.commonprefix([text, self.previous_main]))
                cached, self.previous_main = n // 4, text
            step = tool_calls_so_far(api, body)
            if step < len(self.script):
                name, args = tool_call(api, tools, self.script[step], self.workdir)
                answer = Answer(tool=name, arguments=json.dumps(args))
            else:
                quoted = last_tool_result(api, body)[:400]
                answer = Answer(text=f"Done. The last tool result began:\n\n{quoted}")
        else:
            answer = Answer(text=SIDE_TEXT)
        out = (len(answer.text) + len(answer.arguments)) // 4 + 1
        return answer, {"prompt": prompt, "cached": cached, "output": out}


# ---------------------------------------------------------------- the three wires


def _chunks(s: str, n: int = 3) -> list[str]:
    """``s`` in ``n`` pieces (a stream of several deltas, as a model sends)."""
    size = max(1, -(-len(s) // n))
    return [s[i : i + size] for i in range(0, len(s), size)] or [""]


def messages_events(a: Answer, u: dict[str, int], model: str) -> Iterator[tuple[str, dict]]:
    usage = {
        "input_tokens": u["prompt"] - u["cached"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u["cached"],
        "output_tokens": 1,
    }
    msg = {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    yield "message_start", {"type": "message_start", "message": msg}
    if a.tool:
        block = {
            "type": "tool_use",
            "id": "toolu_" + uuid.uuid4().hex[:24],
            "name": a.tool,
            "input": {},
        }
        deltas = [{"type": "input_json_delta", "partial_json": p} for p in _chunks(a.arguments)]
    else:
        block = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": p} for p in _chunks(a.text)]
    yield "content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}
    for d in deltas:
        yield "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": d}
    yield "content_block_stop", {"type": "content_block_stop", "index": 0}
    delta = {"stop_reason": "tool_use" if a.tool else "end_turn", "stop_sequence": None}
    yield (
        "message_delta",
        {"type": "message_delta", "delta": delta, "usage": {"output_tokens": u["output"]}},
    )
    yield "message_stop", {"type": "message_stop"}


def messages_whole(a: Answer, u: dict[str, int], model: str) -> dict[str, Any]:
    if a.tool:
        content = [
            {
                "type": "tool_use",
                "id": "toolu_" + uuid.uuid4().hex[:24],
                "name": a.tool,
                "input": json.loads(a.arguments),
            }
        ]
    else:
        content = [{"type": "text", "text": a.text}]
    return {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if a.tool else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": u["prompt"] - u["cached"],
            "output_tokens": u["output"],
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u["cached"],
        },
    }


def responses_events(a: Answer, u: dict[str, int], model: str) -> Iterator[tuple[str, dict]]:
    rid = "resp_" + uuid.uuid4().hex
    response = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "usage": None,
    }
    seq = iter(range(1_000_000))

    def event(kind: str, **fields: Any) -> tuple[str, dict]:
        return kind, {"type": kind, "sequence_number": next(seq), **fields}

    yield event("response.created", response=response)
    yield event("response.in_progress", response=response)
    if a.tool:
        item = {
            "id": "fc_" + uuid.uuid4().hex,
            "type": "function_call",
            "status": "in_progress",
            "call_id": "call_" + uuid.uuid4().hex[:24],
            "name": a.tool,
            "arguments": "",
        }
        yield event("response.output_item.added", output_index=0, item=item)
        for p in _chunks(a.arguments):
            yield event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=0,
                delta=p,
            )
        yield event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=0,
            arguments=a.arguments,
        )
        done = {**item, "status": "completed", "arguments": a.arguments}
    else:
        item = {
            "id": "msg_" + uuid.uuid4().hex,
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        yield event("response.output_item.added", output_index=0, item=item)
        part = {"type": "output_text", "text": "", "annotations": []}
        ids = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        yield event("response.content_part.added", **ids, part=part)
        for p in _chunks(a.text):
            yield event("response.output_text.delta", **ids, delta=p)
        yield event("response.output_text.done", **ids, text=a.text)
        part = {**part, "text": a.text}
        yield event("response.content_part.done", **ids, part=part)
        done = {**item, "status": "completed", "content": [part]}
    yield event("response.output_item.done", output_index=0, item=done)
    usage = {
        "input_tokens": u["prompt"],
        "input_tokens_details": {"cached_tokens": u["cached"]},
        "output_tokens": u["output"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["prompt"] + u["output"],
    }
    final = {**response, "status": "completed", "output": [done], "usage": usage}
    yield event("response.completed", response=final)


def chat_chunks(a: Answer, u: dict[str, int], model: str, with_usage: bool) -> Iterator[dict]:
    head = {
        "id": "chatcmpl-" + uuid.uuid4().hex[:24],
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    if a.tool:
        call = {
            "index": 0,
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": a.tool, "arguments": ""},
        }
        yield chunk({"tool_calls": [call]})
        for p in _chunks(a.arguments):
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]})
        yield chunk({}, "tool_calls")
    else:
        for p in _chunks(a.text):
            yield chunk({"content": p})
        yield chunk({}, "stop")
    if with_usage:
        yield {**head, "choices": [], "usage": chat_usage(u)}


def chat_usage(u: dict[str, int]) -> dict[str, Any]:
    return {
        "prompt_tokens": u["prompt"],
        "completion_tokens": u["output"],
        "total_tokens": u["prompt"] + u["output"],
        "prompt_tokens_details": {"cached_tokens": u["cached"]},
    }


def chat_whole(a: Answer, u: dict[str, int], model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": a.text or None}
    if a.tool:
        message["tool_calls"] = [
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {"name": a.tool, "arguments": a.arguments},
            }
        ]
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex[:24],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if a.tool else "stop"}
        ],
        "usage": chat_usage(u),
    }


# ---------------------------------------------------------------- HTTP


def make_handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def _json(self, obj: Any, status: int = 200) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _sse(self, events: Iterator[tuple[str | None, Any]]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for name, data in events:
                head = f"event: {name}\n" if name else ""
                payload = data if isinstance(data, str) else json.dumps(data)
                self.wfile.write(f"{head}data: {payload}\n\n".encode())
                self.wfile.flush()
            self.close_connection = True

        def do_GET(self) -> None:  # noqa: N802
            if urlsplit(self.path).path.rstrip("/") == "/v1/models":
                model = {"id": "local", "object": "model", "created": 0, "owned_by": "recorder"}
                self._json({"object": "list", "data": [model]})
            else:
                self._json({"error": {"message": f"no route {self.path}"}}, 404)

        def do_POST(self) -> None:  # noqa: N802
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n)
            api = api_of(self.path)
            headers = {k: v for k, v in self.headers.items() if k.lower() in KEPT_HEADERS}
            try:
                body = json.loads(raw or b"null")
            except ValueError:
                body = raw.decode(errors="replace")
            recorder.record(api, self.path, headers, body)
            if api is None or not isinstance(body, dict):
                self._json({"error": {"message": f"no route {self.path}"}}, 404)
                return
            answer, u = recorder.answer(api, body)
            model = str(body.get("model") or "local")
            stream = bool(body.get("stream"))
            if api == "messages":
                if stream:
                    self._sse(messages_events(answer, u, model))
                else:
                    self._json(messages_whole(answer, u, model))
            elif api == "responses":
                self._sse(responses_events(answer, u, model))
            elif stream:
                with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                chunks = ((None, c) for c in chat_chunks(answer, u, model, with_usage))
                self._sse(iter([*chunks, (None, "[DONE]")]))
            else:
                self._json(chat_whole(answer, u, model))

    return Handler


class RecorderServer:
    """The recorder on ``127.0.0.1:port`` (0: any free port) in a daemon thread."""

    def __init__(self, out: Path, workdir: Path, script: str = "tour", port: int = 0) -> None:
        self.recorder = Recorder(out, workdir, SCRIPTS[script])
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), make_handler(self.recorder))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> RecorderServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ---------------------------------------------------------------- recording a session

SAMPLE_PROJECT = {
    "notes.txt": "Release checklist for shapes 0.3\n- bump the version\n- run the tests\n",
    "README.md": "# shapes\n\nArea and perimeter of plane shapes, with unit conversion.\n\n"
    "    from shapes import Circle\n    Circle(2).area()\n",
    "pyproject.toml": '[project]\nname = "shapes"\nversion = "0.2.0"\n'
    'requires-python = ">=3.10"\n\n[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
    "shapes/__init__.py": '"""Plane shapes."""\n\nfrom .geometry import Circle, Rectangle\n'
    'from .units import convert\n\n__all__ = ["Circle", "Rectangle", "convert"]\n',
    "shapes/geometry.py": '"""Shapes with an area and a perimeter."""\n\nimport math\n'
    "from dataclasses import dataclass\n\n\n@dataclass(frozen=True)\nclass Circle:\n"
    "    radius: float\n\n    def area(self) -> float:\n        return math.pi * self.radius**2\n\n"
    "    def perimeter(self) -> float:\n        return 2 * math.pi * self.radius\n\n\n"
    "@dataclass(frozen=True)\nclass Rectangle:\n    width: float\n    height: float\n\n"
    "    def area(self) -> float:\n        return self.width * self.height\n\n"
    "    def perimeter(self) -> float:\n        return 2 * (self.width + self.height)\n",
    "shapes/units.py": '"""Length units."""\n\nTO_METRES = {"mm": 0.001, "cm": 0.01, "m": 1.0, '
    '"in": 0.0254, "ft": 0.3048}\n\n\ndef convert(value: float, src: str, dst: str) -> float:\n'
    '    """``value`` in ``src`` units, in ``dst`` units; KeyError for an unknown unit."""\n'
    "    return value * TO_METRES[src] / TO_METRES[dst]\n",
    "tests/test_geometry.py": "import math\n\nfrom shapes import Circle, Rectangle\n\n\n"
    "def test_circle_area():\n    assert math.isclose(Circle(1).area(), math.pi)\n\n\n"
    "def test_rectangle_perimeter():\n    assert Rectangle(2, 3).perimeter() == 10\n",
}
TOUR_TASK = (
    "Look through this project: list its files, read the README, the modules and the tests, "
    "then say in a few sentences what each module does and name one test that is missing."
)


LARGE_TASK = (
    "Read these source files of this project one by one, in this order, and after each one "
    "summarize what it does in a few sentences: " + ", ".join(LARGE_FILES) + ". Then count "
    "their lines and functions, list the classes of the two cache modules and the files of "
    "the cache package, and say which file is the largest."
)
TASKS = {"tour": TOUR_TASK, "read-large": LARGE_TASK, "notes": "Read notes.txt."}
OUT_NAMES = {"tour": "agent-{name}", "read-large": "agent-{name}-long", "notes": "agent-{name}"}


def write_sample_project(root: Path, script: str = "tour") -> None:
    """The scratch project: the small package, plus (``read-large``) the files of
    :data:`LARGE_FILES` copied from this repository under the same relative paths."""
    for rel, text in SAMPLE_PROJECT.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    if script == "read-large":
        for rel in LARGE_FILES:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / rel, root / rel)


def neutral(text: str, scratch: Path) -> str:
    """``text`` (JSON lines) with the scratch dirs named as a neutral home and project, and
    Claude Code's device id (``metadata.user_id``) as zeros."""
    for real, shown in (
        (scratch / "project", "/home/user/project"),
        (scratch / "home", "/home/user"),
    ):
        text = text.replace(str(real), shown).replace(json.dumps(str(real))[1:-1], shown)
    text = text.replace(str(scratch), "/home/user/scratch")
    # Claude Code's memory dir names the project as its path, every other character a dash
    text = text.replace(
        re.sub(r"[^A-Za-z0-9]", "-", str(scratch / "project")), "-home-user-project"
    )
    for device in set(re.findall(r"device_id\W+([0-9a-f]{32,})", text)):  # Claude Code's
        text = text.replace(device, "0" * len(device))
    return text


def record(name: str, timeout_s: float = 600, script: str = "tour") -> Path:
    """Run CLI ``name`` against the recorder with ``script`` and its task; write the
    session to ``cli/workloads/`` (``agent-<name>.jsonl``; ``read-large``:
    ``agent-<name>-long.jsonl.gz``). Returns the file written."""
    sys.path.insert(0, str(ROOT / "tests"))
    import agent_kit  # tests/agent_kit.py: the pinned CLIs and their configs

    bins = agent_kit.install_clis()
    scratch = Path(tempfile.mkdtemp(prefix="agent-rec-"))
    try:
        project, log = scratch / "project", scratch / "log.jsonl"
        project.mkdir()
        write_sample_project(project, script)
        with RecorderServer(log, project, script) as server:
            task = TASKS[script]
            run = agent_kit.invocation(name, bins, server.url, project, scratch / "home", task)
            result = agent_kit.run_cli(run, timeout_s)
        print(result.stdout[-2000:], result.stderr[-2000:], sep="\n", file=sys.stderr)
        if result.returncode != 0:
            raise SystemExit(f"{name} exited {result.returncode}")
        lines = [json.loads(x) for x in neutral(log.read_text(), scratch).splitlines()]
        text = "".join(json.dumps(x) + "\n" for x in lines if x["api"])
        out = ROOT / "cli" / "workloads" / (OUT_NAMES[script].format(name=name) + ".jsonl")
        for stale in (out, out.with_suffix(".jsonl.gz")):
            stale.unlink(missing_ok=True)
        if len(text) > 1_000_000:
            out = out.with_suffix(".jsonl.gz")
            out.write_bytes(gzip.compress(text.encode(), mtime=0))
        else:
            out.write_text(text)
        print(f"{out}: {len(lines)} requests, {len(text)} bytes of JSON", file=sys.stderr)
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the recorder until interrupted")
    s.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    s.add_argument("--workdir", type=Path, required=True, help="where the scripted paths lie")
    s.add_argument("--script", choices=sorted(SCRIPTS), default="tour")
    s.add_argument("--port", type=int, default=0)
    r = sub.add_parser("record", help="record one CLI's session into cli/workloads/")
    r.add_argument("name", choices=["claude-code", "codex", "opencode", "all"])
    r.add_argument("--timeout-s", type=float, default=600)
    r.add_argument(
        "--script",
        choices=sorted(SCRIPTS),
        default="tour",
        help="tour (the short sessions) or read-large (agent-<name>-long.jsonl.gz, past 64K)",
    )
    args = p.parse_args(argv)
    if args.cmd == "record":
        names = ["claude-code", "codex", "opencode"] if args.name == "all" else [args.name]
        for name in names:
            record(name, args.timeout_s, args.script)
        return 0
    with RecorderServer(args.out, args.workdir.resolve(), args.script, args.port) as server:
        print(f"recording on {server.url}/v1", file=sys.stderr, flush=True)
        try:
            server.thread.join()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
