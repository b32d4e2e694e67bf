"""The agent CLIs (Claude Code, Codex CLI, OpenCode) for tests and recordings: installed once
from npm at pinned versions, configured for a local base URL, run headless in a scratch
HOME with a time bound.

Versions and configs as checked offline on this kind of machine (the README's "Agents"
section says the same for users): Claude Code speaks Anthropic Messages (``POST
/v1/messages?beta=true``), Codex CLI the OpenAI Responses API (``wire_api =
"responses"``), OpenCode chat completions through ``@ai-sdk/openai-compatible``.

:func:`install_clis` calls ``pytest.skip`` (with the reason) when ``node``/``npm`` is
missing or the install fails (no network, no npm cache): outside pytest that raises
``Skipped``, an exception like any other.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal

import pytest

AgentName = Literal["claude-code", "codex", "opencode"]
AGENTS: tuple[AgentName, ...] = ("claude-code", "codex", "opencode")
PACKAGES = {
    "claude-code": "@anthropic-ai/claude-code@2.1.328",
    "codex": "@openai/codex@0.169.0",
    "opencode": "opencode-ai@1.18.33",
}
BIN_NAMES = {"claude-code": "claude", "codex": "codex", "opencode": "opencode"}
API_KEY = "local-key-not-checked"
# variables of a developer's own setup that would steer a CLI away from the base URL given
_DROPPED_ENV = ("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_", "OPENCODE_", "XDG_")


def cache_dir() -> Path:
    """``$TIERCHAT_AGENTS_DIR``, else ``~/.cache/tierchat-agents/<hash of the versions>``."""
    env = os.environ.get("TIERCHAT_AGENTS_DIR")
    if env:
        return Path(env).expanduser()
    digest = hashlib.sha256(" ".join(sorted(PACKAGES.values())).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "tierchat-agents" / digest


def install_clis(timeout_s: float = 600) -> dict[AgentName, Path]:
    """The three CLIs' executables, installed into :func:`cache_dir` on first use
    (``npm install --prefix``; later calls find them and run nothing). Skips the calling
    test when node or npm is missing or the install fails."""
    root = cache_dir()
    bins = {name: root / "node_modules" / ".bin" / BIN_NAMES[name] for name in AGENTS}
    if all(b.exists() for b in bins.values()):
        return bins
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"the agent CLIs need {tool}, which is not on PATH")
    root.mkdir(parents=True, exist_ok=True)
    cmd = ["npm", "install", "--prefix", str(root), "--no-audit", "--no-fund", *PACKAGES.values()]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install of the agent CLIs took over {timeout_s:.0f} s (no network?)")
    missing = [str(b) for b in bins.values() if not b.exists()]
    if r.returncode != 0 or missing:
        tail = (r.stderr or r.stdout).strip()[-600:]
        pytest.skip(f"npm install of the agent CLIs failed (exit {r.returncode}): {tail}")
    return bins


@dataclass(frozen=True)
class Invocation:
    """One headless CLI run: the command, its environment and its working directory."""

    name: AgentName
    cmd: list[str]
    env: dict[str, str]
    cwd: Path


def scratch_home(home: Path) -> dict[str, str]:
    """An environment whose HOME and XDG dirs lie under ``home`` (created), so a run reads
    and writes nothing of the user's; the caller's PATH and locale are kept."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED_ENV)}
    env["HOME"] = str(home)
    for var, sub in (
        ("XDG_CONFIG_HOME", ".config"),
        ("XDG_DATA_HOME", ".local/share"),
        ("XDG_CACHE_HOME", ".cache"),
        ("XDG_STATE_HOME", ".local/state"),
    ):
        env[var] = str(home / sub)
        (home / sub).mkdir(parents=True, exist_ok=True)
    return env


def claude_env(base_url: str) -> dict[str, str]:
    """Claude Code's variables for a local Messages server at ``base_url`` (no ``/v1``)."""
    return {
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": API_KEY,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }


def write_codex_config(
    codex_home: Path, base_url: str, model: str = "local", context_tokens: int | None = None
) -> Path:
    """``config.toml`` in ``codex_home`` pointing Codex at ``base_url`` over the Responses
    wire; the key is read from ``LOCAL_KEY``. Codex sends no output limit (the server's
    default applies)."""
    codex_home.mkdir(parents=True, exist_ok=True)
    path = codex_home / "config.toml"
    window = f"model_context_window = {context_tokens}\n" if context_tokens else ""
    path.write_text(
        f"model = {json.dumps(model)}\n"
        'model_provider = "local"\n'
        f"{window}\n"
        "[model_providers.local]\n"
        'name = "local"\n'
        f"base_url = {json.dumps(base_url.removesuffix('/v1') + '/v1')}\n"
        'wire_api = "responses"\n'
        'env_key = "LOCAL_KEY"\n'
    )
    return path


def write_opencode_config(
    config_home: Path,
    base_url: str,
    model: str = "local",
    context_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> Path:
    """OpenCode's global ``opencode.json`` under ``config_home`` (``$XDG_CONFIG_HOME``):
    one OpenAI-compatible provider ``local`` at ``base_url`` and its one model (with
    ``limit.context`` / ``limit.output`` when both are given: its ``max_tokens``)."""
    entry: dict[str, object] = {"name": model}
    if context_tokens and max_output_tokens:
        entry["limit"] = {"context": context_tokens, "output": max_output_tokens}
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "local",
        "options": {"baseURL": base_url.removesuffix("/v1") + "/v1", "apiKey": API_KEY},
        "models": {model: entry},
    }
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"local": provider},
        "model": f"local/{model}",
        "autoupdate": False,
        "share": "disabled",
    }
    path = config_home / "opencode" / "opencode.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))
    return path


def invocation(
    name: AgentName,
    bins: dict[AgentName, Path],
    base_url: str,
    workdir: Path,
    home: Path,
    task: str,
    model: str = "local",
    context_tokens: int | None = None,
    max_output_tokens: int | None = None,
    max_turns: int | None = None,
) -> Invocation:
    """The headless run of ``name`` on ``task`` in ``workdir`` against ``base_url``, with its
    config written under the scratch ``home``. Claude Code may use Read and Bash; Codex runs
    in its read-only sandbox; OpenCode with its default tools. ``context_tokens`` and
    ``max_output_tokens`` (None: each CLI's own, 32000 output tokens for two of them) are
    passed where the CLI takes them (Codex: only the window)."""
    env = scratch_home(home)
    exe = str(bins[name])
    if name == "claude-code":
        env.update(claude_env(base_url))
        if max_output_tokens:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output_tokens)
        cmd = [exe, "-p", task, "--model", model, "--allowedTools", "Read", "Bash"]
        if max_turns:  # Claude Code's own bound on its tool rounds (print mode)
            cmd += ["--max-turns", str(max_turns)]
    elif name == "codex":
        codex_home = home / ".codex"
        write_codex_config(codex_home, base_url, model, context_tokens)
        env.update({"CODEX_HOME": str(codex_home), "LOCAL_KEY": API_KEY})
        cmd = [exe, "exec", "--skip-git-repo-check", "-s", "read-only", task]
    else:
        config_home = Path(env["XDG_CONFIG_HOME"])
        write_opencode_config(config_home, base_url, model, context_tokens, max_output_tokens)
        cmd = [exe, "run", task]
    return Invocation(name, cmd, env, workdir)


def run_cli(run: Invocation, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """Runs ``run`` to its end, stdin closed; past ``timeout_s`` its whole process group is
    killed and the result has returncode -9 and what it had printed."""
    proc = subprocess.Popen(
        run.cmd,
        cwd=run.cwd,
        env={**run.env, "PWD": str(run.cwd)},  # OpenCode takes its project dir from $PWD
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[killed after {timeout_s:.0f} s]"
        return subprocess.CompletedProcess(run.cmd, -9, out, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(run.cmd, proc.returncode, out, err)


# ---------------------------------------------------------------- what the server replied


@dataclass(frozen=True)
class Exchange:
    """One request through :class:`LoggingProxy` and the server's reply, whole (an SSE
    stream as its bytes)."""

    seq: int  # arrival order at the proxy
    path: str
    body: dict
    status: int
    reply: bytes

    @property
    def has_tools(self) -> bool:
        return bool(self.body.get("tools"))

    @property
    def ended(self) -> bool:
        """The reply reached its end: a whole JSON body, or a stream with its last event
        (``message_stop``, ``response.completed``/``incomplete``/``failed``, ``data:
        [DONE]``). False when the client left first: Claude Code gives up on a stream
        after 300 s without a chunk (30 pings extend it at most 300 s more) and asks again
        without streaming."""
        if b"data: [DONE]" in self.reply:
            return True
        last = {"message_stop", "response.completed", "response.incomplete", "response.failed"}
        objs = _payloads(self.reply)
        if self.reply.lstrip().startswith(b"{"):
            return bool(objs)
        return any(o.get("type") in last for o in objs)


@dataclass(frozen=True)
class Usage:
    """Tokens of one reply as the server reported them: the whole prompt, the part of it
    served from cache, and the reply."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


def _payloads(reply: bytes) -> list[dict]:
    """The JSON objects of a reply: its ``data:`` lines for a stream, else the one body."""
    text = reply.decode("utf-8", errors="replace")
    if not text.lstrip().startswith("{"):
        lines = [x[5:].strip() for x in text.splitlines() if x.startswith("data:")]
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:  # "[DONE]"
                pass
        return [x for x in out if isinstance(x, dict)]
    try:
        obj = json.loads(text)
    except ValueError:
        return []
    return [obj] if isinstance(obj, dict) else []


def usage_of(exchange: Exchange) -> Usage | None:
    """The usage of a reply, by the fields of its wire, streamed or whole; None if absent.

    - Messages (path ``/v1/messages``): ``message_start.message.usage`` (or the message's
      ``usage``), each field updated by the last ``message_delta``'s usage (as the SDK
      accumulates it; tierchat sends the cached split there, known after the prefill):
      prompt = ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens``
      (Anthropic's ``input_tokens`` counts only the uncached part), cached =
      ``cache_read_input_tokens``, output ``output_tokens``.
    - Responses (``/v1/responses``): ``response.completed``'s (or ``response.incomplete``'s)
      ``response.usage``:
      ``input_tokens``, ``input_tokens_details.cached_tokens``, ``output_tokens``.
    - Chat (``/v1/chat/completions``): the chunk (or reply) with ``usage``:
      ``prompt_tokens``, ``prompt_tokens_details.cached_tokens``, ``completion_tokens``.
    """
    path = exchange.path.split("?")[0].rstrip("/")
    objs = _payloads(exchange.reply)
    if path.endswith("/messages"):
        start = next(
            (o["message"].get("usage") for o in objs if o.get("type") == "message_start"), None
        )
        start = start or next((o.get("usage") for o in objs if o.get("type") == "message"), None)
        if not start:
            return None
        final = dict(start)
        for o in objs:
            if o.get("type") == "message_delta" and o.get("usage"):
                final.update({k: v for k, v in o["usage"].items() if v is not None})
        cached = final.get("cache_read_input_tokens") or 0
        prompt = (final.get("input_tokens") or 0) + cached
        output = final.get("output_tokens") or 0
        return Usage(prompt + (final.get("cache_creation_input_tokens") or 0), cached, output)
    if path.endswith("/responses"):
        u = next(
            (
                o["response"].get("usage")
                for o in objs
                if o.get("type") in ("response.completed", "response.incomplete")
            ),
            None,
        )
        u = u or next((o.get("usage") for o in objs if o.get("object") == "response"), None)
        if not u:
            return None
        cached = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
        return Usage(u["input_tokens"], cached, u.get("output_tokens") or 0)
    u = next((o["usage"] for o in reversed(objs) if o.get("usage")), None)
    if not u:
        return None
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Usage(u["prompt_tokens"], cached, u.get("completion_tokens") or 0)


# the template's assistant header at the end of a prompt (``<|im_start|>assistant\n`` is 3
# tokens on Qwen2.5): a client that drops an empty reply (Claude Code: "your previous
# response had no visible output") sends the next prompt without it
ASSISTANT_HEADER_TOKENS = 4


def cache_shortfalls(exchanges: list[Exchange]) -> list[str]:
    """What breaks "each main request after the first is served from the cache" in a
    session: for the main requests (those with ``tools``) in order, request ``i`` must
    report ``cached_tokens >= prompt_tokens[i-1] - output_tokens[i-1]`` (the previous
    prompt, less the previous reply's length as slack for how a chat template re-renders
    the turn it ends with), less :data:`ASSISTANT_HEADER_TOKENS` after an empty reply
    (1 token: the end token). A missing usage is a shortfall too. A reply the client left
    before its end (:attr:`Exchange.ended` false) is passed over: it has no final usage,
    and how much of its prompt the server kept is the server's to say; the request after
    it is held to the last reply that ended. Empty: all held."""
    main = [e for e in exchanges if e.has_tools and e.ended]
    problems: list[str] = []
    previous: Usage | None = None
    for i, e in enumerate(main):
        u = usage_of(e)
        if u is None:
            problems.append(f"main request {i} ({e.path}, HTTP {e.status}): no usage in reply")
            previous = None
            continue
        if previous is not None:
            floor = previous.prompt_tokens - previous.output_tokens
            if previous.output_tokens <= 1:
                floor -= ASSISTANT_HEADER_TOKENS
            if u.cached_tokens < floor:
                problems.append(
                    f"main request {i}: cached {u.cached_tokens} < {floor} (previous prompt "
                    f"{previous.prompt_tokens} - its reply {previous.output_tokens})"
                )
        previous = u
    return problems


class LoggingProxy:
    """A reverse proxy on ``127.0.0.1`` (any free port) in a daemon thread that forwards
    every request to ``upstream`` and keeps each request and its whole reply as an
    :class:`Exchange`. Replies are passed on as they arrive (streams stay streams), each
    on a connection closed after it."""

    def __init__(self, upstream: str) -> None:
        import httpx  # a dependency of tierchat (its HTTP tests and bench clients)

        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._arrivals = itertools.count()
        self._client = httpx.Client(timeout=httpx.Timeout(None, connect=10))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

            def _forward(self, method: str) -> None:
                with proxy._lock:
                    seq = next(proxy._arrivals)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                headers["Accept-Encoding"] = "identity"  # the kept reply stays readable
                reply = bytearray()
                request = proxy._client.build_request(
                    method, proxy.upstream + self.path, headers=headers, content=raw or None
                )
                try:
                    upstream = proxy._client.send(request, stream=True)
                except Exception as e:  # noqa: BLE001 - any failure reaches the client as 502
                    upstream = None
                    reply += f'{{"error": {{"message": "proxy: {type(e).__name__}"}}}}'.encode()
                status = upstream.status_code if upstream is not None else 502
                try:
                    self.send_response(status)
                    kept = upstream.headers.items() if upstream is not None else []
                    for k, v in kept:
                        if k.lower() not in _HOP_HEADERS and k.lower() != "content-length":
                            self.send_header(k, v)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    if upstream is None:
                        self.wfile.write(bytes(reply))
                    else:
                        for piece in upstream.iter_raw():
                            reply += piece
                            self.wfile.write(piece)
                            self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError, httpx.HTTPError):
                    pass  # a side left: the client (closing upstream cancels it) or the server
                finally:
                    if upstream is not None:
                        upstream.close()
                    self.close_connection = True
                    try:
                        body = json.loads(raw) if raw else {}
                    except ValueError:
                        body = {}
                    with proxy._lock:
                        proxy.exchanges.append(
                            Exchange(
                                seq,
                                self.path,
                                body if isinstance(body, dict) else {},
                                status,
                                bytes(reply),
                            )
                        )

            def do_GET(self) -> None:  # noqa: N802
                self._forward("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._forward("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> LoggingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._client.close()

    def posts(self) -> list[Exchange]:
        """The POSTed exchanges so far (the model requests), in the order they came."""
        with self._lock:
            return sorted((e for e in self.exchanges if e.body), key=lambda e: e.seq)


_HOP_HEADERS = {
    "host",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-connection",
    "accept-encoding",
}
