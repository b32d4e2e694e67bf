"""Issue 22: ``tierchat serve`` on the real engine (tiny:llama, a 272-token vocabulary and a
131,072-token context) under hostile clients. Each case drives the server over HTTP (the
openai client where it fits, raw httpx for malformed requests) and then checks the server
still answers a normal request with the output of a cold run.

Signals (a real ``tierchat serve`` subprocess): tests/system/test_serve_signals.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
from engine_kit import make_engine
from tierchat.cli.serve import _print_record
from tierchat.core.chat.prompts import PromptBuilder
from tierchat.core.live_status import STATUS_FILE, StatusService
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.app import create_app
from tierchat.core.serve.limits import ServeLimits, context_length, vocab_size
from tierchat.core.serve.log import RequestLog, TrackedEngine
from tierchat.core.serve.server import ServerThread
from tierchat.core.serve.state import ServeState

JSON = {"Content-Type": "application/json"}
NORMAL = [{"role": "user", "content": "the quick brown fox jumps over a lazy dog"}]
MAX_TOKENS = 8


class Served:
    """A real engine behind a guarded server; ``cold`` is the reply of a cold run (the
    same engine with ``use_cache=False``) to :data:`NORMAL`, taken before any test."""

    def __init__(self, tmp: Path, models_dir: Path, limits: ServeLimits | None = None):
        self.tmp = tmp
        self.raw = make_engine("tiny:llama", tmp, models_dir)
        self.engine = TrackedEngine(self.raw, RequestLog())
        self.limits = limits or ServeLimits()
        self.state = ServeState(
            self.engine,
            sampling=SamplingParams(max_tokens=MAX_TOKENS),
            memory_path=tmp / "data" / "serve-replies" / "m.jsonl",
            limits=self.limits,
        )
        self.server = ServerThread(create_app(self.state), limits=self.limits).start()
        self.url = self.server.url
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120
        )
        cold_state = ServeState(
            self.engine, sampling=SamplingParams(max_tokens=MAX_TOKENS), use_cache=False
        )
        with ServerThread(create_app(cold_state)) as cold_server:
            cold = openai.OpenAI(base_url=cold_server.url + "/v1", api_key="x", max_retries=0)
            self.cold = self.chat(NORMAL, client=cold)

    def chat(self, messages, client=None, **kw) -> str:
        r = (client or self.client).chat.completions.create(
            model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, **kw
        )
        return r.choices[0].message.content

    def post(self, path: str, body, headers=None, **kw) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(
            self.url + path, content=content, headers={**JSON, **(headers or {})}, timeout=60, **kw
        )

    def still_normal(self) -> None:
        """The server answers a normal request, with the cold run's reply."""
        assert self.chat(NORMAL) == self.cold
        assert httpx.get(self.url + "/health").json()["status"] == "ok"

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture
def served(tmp_path, models_dir):
    s = Served(tmp_path, models_dir)
    yield s
    s.close()


def assert_error(r: httpx.Response, status: int, code: str | None = None, text: str = ""):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if code is not None:
        assert body["error"]["code"] == code
    assert text in body["error"]["message"]
    return body["error"]


# ---------------------------------------------------------------- case 1


def test_1_token_ids_outside_the_vocabulary_are_400_before_any_work(served):
    vocab = vocab_size(served.engine)
    assert vocab == 272  # tiny:llama's embedding rows (its tokenizer names 261 of them)
    before = served.state.log.snapshot().total
    for ids in ([1, 100000], [vocab], [272], [1000], [-1], [1, 2**40]):
        r = served.post("/v1/completions", {"prompt": ids, "max_tokens": 1})
        assert_error(r, 400, "invalid_token_id", "outside the vocabulary")
    assert served.state.log.snapshot().total == before  # nothing reached the engine
    ok = served.post("/v1/completions", {"prompt": [1, vocab - 1], "max_tokens": 1})
    assert ok.status_code == 200
    served.still_normal()


def test_1_the_bound_is_the_models_rows_also_in_a_text_config(tmp_path, models_dir):
    """tiny:qwen3_5 keeps vocab_size and its context in ``text_config``; its tokenizer
    names fewer ids than the model generates."""
    engine = TrackedEngine(make_engine("tiny:qwen3_5", tmp_path, models_dir), RequestLog())
    try:
        assert vocab_size(engine) == 272 > len(engine.tokenizer)
        assert context_length(engine) == 131072
    finally:
        engine.close()


def test_1_a_web_page_cannot_drive_or_read_a_loopback_server(served):
    body = {"prompt": [1, 2], "max_tokens": 1}
    plain = served.post("/v1/completions", body, headers={"Content-Type": "text/plain"})
    assert_error(plain, 415, "unsupported_media_type")
    for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example"):
        r = served.post("/v1/completions", body, headers={"Origin": origin})
        assert_error(r, 403, "origin_not_allowed")
        assert httpx.get(served.url + "/v1/models", headers={"Origin": origin}).status_code == 403
    # DNS rebinding: the page's own name resolved to 127.0.0.1
    for host in ("evil.example", "evil.example:8000", "10.0.0.1"):
        r = served.post("/v1/completions", body, headers={"Host": host})
        assert_error(r, 403, "host_not_allowed")
        assert httpx.get(served.url + "/health", headers={"Host": host}).status_code == 403
    port = served.server.port
    for origin in (f"http://localhost:{port}", "http://127.0.0.1:3000", "http://[::1]:5173"):
        r = served.post("/v1/completions", body, headers={"Origin": origin})
        assert r.status_code == 200, origin
    assert served.post("/v1/completions", body, headers={"Host": "localhost"}).status_code == 200
    served.still_normal()


def test_1_configured_hosts_and_origins_pass(tmp_path, models_dir):
    limits = ServeLimits(allowed_hosts=("tierchat.lan",), allowed_origins=("https://app.lan",))
    s = Served(tmp_path, models_dir, limits)
    try:
        body = {"prompt": [1, 2], "max_tokens": 1}
        headers = {"Host": "tierchat.lan:8000", "Origin": "https://app.lan"}
        assert s.post("/v1/completions", body, headers=headers).status_code == 200
        r = s.post("/v1/completions", body, headers={"Origin": "https://other.lan"})
        assert_error(r, 403, "origin_not_allowed")
        s.still_normal()
    finally:
        s.close()


# ---------------------------------------------------------------- case 2


def test_2_prompts_past_the_context_are_400_context_length_exceeded(served):
    assert served.raw.context_length == 131072
    before = served.state.log.snapshot().total
    long_ids = [5] * 131072
    r = served.post("/v1/completions", {"prompt": long_ids, "max_tokens": 1})
    assert_error(r, 400, "context_length_exceeded", "maximum context length is 131072")
    # a client's own max_tokens must fit beside the prompt, as OpenAI checks
    r = served.post("/v1/completions", {"prompt": [5] * 131000, "max_tokens": 200})
    assert_error(r, 400, "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as info:
        served.chat([{"role": "user", "content": "word " * 27000}])
    assert info.value.body["code"] == "context_length_exceeded"
    assert served.state.log.snapshot().total == before  # refused before any prefill
    # the server's default max_tokens is capped to the room left instead; checked at a
    # 4,096-token context (a 131,066-token prefill takes minutes on a CPU)
    # (the loaded model's figures are read once, at load: core/api.py ModelInfo)
    engine = served.raw
    runtime = engine.runtime
    engine.runtime = dataclasses.replace(
        runtime, info=dataclasses.replace(runtime.info, context_length=4096)
    )
    try:
        assert served.raw.context_length == 4096
        r = served.post("/v1/completions", {"prompt": [5] * 4090})
    finally:
        engine.runtime = runtime
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 6
    served.still_normal()


def test_2_a_body_past_the_limit_is_413_without_reading_it_all(served):
    big = {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    r = served.post("/v1/chat/completions", big)
    assert_error(r, 413, "request_too_large")

    def chunks():  # chunked: no Content-Length to refuse up front
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(6):
            yield b"y" * (1 << 20)
        yield b'"}]}'

    r = httpx.post(served.url + "/v1/chat/completions", content=chunks(), headers=JSON)
    assert_error(r, 413, "request_too_large")
    served.still_normal()


# ---------------------------------------------------------------- case 3


class CountingTokenizer:
    """A real tokenizer whose template renders are counted."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.renders = 0

    def apply_chat_template(self, *a, **kw):
        self.renders += 1
        return self.inner.apply_chat_template(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def conversation(n: int, tag: str = "") -> list[dict]:
    out = []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        out.append({"role": role, "content": f"{tag} message {i} about the fox"})
    return out


# admission by reuse (docs/DESIGN.md §8.6) writes a system prompt's blocks at once; the
# rest waits for reuse, RAM pressure or close: the cases that need files on the SSD tier
# while the server runs send one
SYSTEM = {"role": "system", "content": "You are a careful assistant who answers briefly. " * 6}


def on_ssd(n: int, tag: str) -> list[dict]:
    """:func:`conversation` after :data:`SYSTEM`: its blocks reach the SSD tier at once."""
    return [SYSTEM, *conversation(n, tag)]


def test_3_a_long_new_conversation_renders_a_bounded_number_of_prefixes(served):
    tok = CountingTokenizer(served.engine.tokenizer)
    unbounded = PromptBuilder(tok)
    unbounded.build(conversation(201))
    assert tok.renders == 1 + 2 * 201  # every message's prefix, twice: O(n^2) text
    tok.renders = 0
    bounded = PromptBuilder(tok, max_renders=16)
    prompt = bounded.build(conversation(201))
    assert tok.renders == 1 + 2 * 16
    assert prompt.token_ids == unbounded.build(conversation(201)).token_ids
    # the next turn: its new messages first among the 16 (they get their boundaries)
    tok.renders = 0
    nxt = bounded.build(conversation(203))
    assert tok.renders == 1 + 2 * 16
    assert [role for _, role in nxt.boundaries[-2:]] == ["assistant", "user"]
    assert nxt.token_ids[: len(prompt.token_ids) - 4] == prompt.token_ids[:-4]


def test_3_large_builds_run_off_the_loop_and_are_dropped_with_their_client(served):
    """Twelve 1000-message requests whose clients leave at once: the server keeps
    answering /health meanwhile, and none of them reaches the engine."""
    before = served.state.log.snapshot().total
    body = json.dumps({"messages": conversation(1001, "big"), "max_tokens": 1}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    socks = []
    for _ in range(12):
        s = socket.create_connection(("127.0.0.1", served.server.port))
        s.sendall(head + body)
        socks.append(s)
    health = httpx.get(served.url + "/health", timeout=30)
    assert health.status_code == 200
    for s in socks:
        s.close()
    deadline = time.monotonic() + 60
    while served.state.build_semaphore().locked() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    assert served.state.log.snapshot().total == before
    served.still_normal()


# ---------------------------------------------------------------- case 4


def test_4_half_open_connections_are_bounded_and_delete_no_cache_file(tmp_path, models_dir):
    limits = ServeLimits(max_connections=16, header_timeout_s=1.0)
    s = Served(tmp_path, models_dir, limits)
    try:
        s.chat(on_ssd(3, "fill"))  # something on the SSD tier
        s.raw.cache.ssd.flush()
        files = sorted(s.raw.cache.ssd.dir.glob("*/*.safetensors"))
        assert files
        half = []
        for _ in range(200):  # headers never finished
            c = socket.create_connection(("127.0.0.1", s.server.port))
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ")
            half.append(c)
        open_fds = len(os.listdir("/proc/self/fd")) if Path("/proc/self/fd").exists() else 0
        # past max_connections the server closes them at once; the rest after 1 s
        time.sleep(2.0)
        closed = 0
        for c in half:
            c.settimeout(0.2)
            try:
                closed += c.recv(1) == b""
            except TimeoutError:  # still open: the guard did not close it
                pass
            except ConnectionResetError:
                closed += 1
        assert closed == len(half)
        for c in half:
            c.close()
        assert sorted(s.raw.cache.ssd.dir.glob("*/*.safetensors")) == files
        assert s.raw.stats().ssd.corrupt == 0
        assert open_fds == 0 or len(os.listdir("/proc/self/fd")) < open_fds
        s.still_normal()
    finally:
        s.close()


# ---------------------------------------------------------------- case 5


def test_5_cache_commands_act_on_the_running_server(served, isolated_settings, capsys):
    from tierchat.cli.main import main

    kv = str(served.tmp / "kv")
    served.chat(on_ssd(3, "five"))
    served.raw.cache.ssd.flush()
    with StatusService(served.raw, served.tmp / "kv", "serve", poll_s=0.05):
        files = served.raw.stats().ssd.entries
        assert files > 0
        assert main(["cache", "stats", "--json", "--cache-dir", kv]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["source"]["process"] == "serve" and data["ssd"]["entries"] == files
        assert data["hot"]["entries"] > 0  # the server's own figures, not a fresh process's
        assert main(["cache", "clear", "ssd", "--cache-dir", kv]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"Cleared ssd: SSD −{files} (")
        assert "\n  by the running tierchat serve" in out
        assert served.raw.stats().ssd.entries == 0  # the server's index knows
    served.chat(on_ssd(3, "five"))  # the same prompt: written again
    served.raw.cache.ssd.flush()
    again = served.raw.stats().ssd.entries
    assert again > 0 and len(list((served.tmp / "kv").glob("*/*/*.safetensors"))) == again
    served.still_normal()


def test_5_a_removed_cache_dir_is_recreated_and_said(served):
    import shutil

    served.chat(conversation(3, "rm"))
    ssd = served.raw.cache.ssd
    ssd.flush()
    shutil.rmtree(served.tmp / "kv")
    served.engine.clear("hot")
    served.chat(conversation(5, "rm"))  # new entries: the writer finds the dir gone
    ssd.flush()
    events = [text for _, text in served.raw.stats().events]
    assert any("was missing; recreated" in t for t in events), events
    assert (served.tmp / "kv" / "lock").exists()
    on_disk = list(ssd.dir.glob("*/*.safetensors"))
    assert on_disk and len(on_disk) == len(ssd)  # the index forgot what went with the dir
    assert (ssd.dir.stat().st_mode & 0o777) == 0o700
    served.still_normal()


def test_5_a_full_disk_is_said_and_retried(served, monkeypatch):
    import errno

    import tierchat.core.cache.ssd.tier as ssd_mod

    real_open = os.open
    full = {"on": True}

    def open_(path, flags, mode=0o777, **kw):
        if full["on"] and str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")  # inodes or blocks
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(ssd_mod.os, "open", open_)
    monkeypatch.setattr(ssd_mod, "RETRY_AFTER_S", 0.0)
    ssd = served.raw.cache.ssd
    served.chat(on_ssd(3, "full"))
    ssd.flush()
    stats = served.raw.stats().ssd
    assert "disk full" in stats.reason and stats.errors > 0
    assert "SSD tier off until then" in stats.reason  # nothing was on disk: cap 0
    full["on"] = False
    served.chat(on_ssd(5, "full"))
    ssd.flush()
    stats = served.raw.stats().ssd
    assert stats.reason == "" and stats.max_bytes == ssd.configured_max_bytes
    assert stats.entries > 0 and len(list(ssd.dir.glob("*/*.safetensors"))) == stats.entries
    events = [text for _, text in served.raw.stats().events]
    assert any("retrying writes" in t for t in events)
    served.still_normal()


# ---------------------------------------------------------------- case 7


def test_7_files_the_server_writes_are_owner_only(served):
    served.chat(on_ssd(3, "modes"))
    served.raw.cache.ssd.flush()
    memory = served.tmp / "data" / "serve-replies" / "m.jsonl"
    for _ in range(3 * served.state.memory.max_entries):  # force a compaction too
        served.state.memory.remember(served.engine.tokenizer, "x", [1, 2])
    with StatusService(served.raw, served.tmp / "kv", "serve"):
        status = served.tmp / "kv" / STATUS_FILE
        paths = [memory, status, served.tmp / "kv" / "lock"]
        entries = list((served.tmp / "kv").glob("*/*/*.safetensors"))
        assert entries  # the system prompt's blocks
        paths += entries
        for path in paths:
            assert (path.stat().st_mode & 0o777) == 0o600, path
        for folder in (memory.parent, served.raw.cache.ssd.dir):
            assert (folder.stat().st_mode & 0o777) == 0o700, folder
    served.still_normal()


def test_7_an_old_world_readable_reply_memory_is_tightened(tmp_path):
    from tierchat.core.serve.prompts import ReplyMemory

    folder = tmp_path / "serve-replies"
    folder.mkdir(mode=0o755)
    path = folder / "m.jsonl"
    path.write_text('["hi", [1, 2]]\n')
    path.chmod(0o644)
    folder.chmod(0o755)

    class Tok:
        def decode(self, ids, **kw):
            return "x"

    memory = ReplyMemory(8, path)
    assert memory.lookup("hi") == (1, 2)
    memory.remember(Tok(), "again", [3])
    assert (path.stat().st_mode & 0o777) == 0o600
    assert (folder.stat().st_mode & 0o777) == 0o700


# ---------------------------------------------------------------- case 9


MALFORMED = [
    (b"[" * 2000, None),
    (b'{"messages": [{"role": ["user"], "content": "x"}]}', "messages.0.role"),
    (b'{"messages": [{"role": {"a": 1}, "content": "x"}]}', "messages.0.role"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": ' + b"9" * 5000 + b"}", None),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}', None),
    (b'{"messages": [{"role": "user", "content": "x"}], "seed": NaN}', None),
    (b'{"messages": [{"role": "user", "content": "x"}], "seed": Infinity}', None),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_p": -1e400}', None),
    (b'{"prompt": [-1]}', "prompt"),
    (b'{"prompt": [1.5]}', "prompt"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    (b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}", None),
    (b'"just a string"', None),
    (b"\xff\xfe", None),
]


@pytest.mark.parametrize("raw,param", MALFORMED, ids=range(len(MALFORMED)))
def test_9_malformed_bodies_are_400s_never_500s(served, raw, param):
    path = "/v1/completions" if raw.startswith(b'{"prompt"') else "/v1/chat/completions"
    r = served.post(path, raw)
    error = assert_error(r, 400)
    assert "Traceback" not in r.text and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    served.still_normal()


def test_9_too_many_messages_is_a_400(tmp_path, models_dir):
    s = Served(tmp_path, models_dir, ServeLimits(max_messages=50))
    try:
        r = s.post("/v1/chat/completions", {"messages": conversation(51)})
        assert_error(r, 400, "too_many_messages")
        s.still_normal()
    finally:
        s.close()


# ---------------------------------------------------------------- case 10


def test_10_control_characters_are_escaped_in_the_log(served, capsys):
    evil = "x\n#999 FAKE done\x1b[2J\x9b31m"
    served.chat(NORMAL, user=evil)
    record = served.state.log.snapshot().records[-1]
    assert "\n" not in record.client and "\x1b" not in record.client
    assert "\\x0a#999 FAKE done\\x1b[2J\\x9b31m" in record.client
    _print_record(record)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "\x9b" not in err
    r = httpx.post(
        served.url + "/v1/chat/completions",
        content=json.dumps({"messages": NORMAL, "max_tokens": 1}).encode(),
        headers={**JSON, "User-Agent": "agent\x1b]0;title\x07/1"},
    )
    assert r.status_code == 200
    assert "\x1b" not in served.state.log.snapshot().records[-1].client
    served.still_normal()


def test_1_a_server_with_a_key_answers_under_any_host_name(tmp_path, models_dir):
    """Remote clients use the machine's name; a rebound page cannot send the key."""
    s = Served(tmp_path, models_dir)
    try:
        s.state.api_key = "k3y"
        headers = {"Host": "gpu-box.lan:8000", "Authorization": "Bearer k3y"}
        assert (
            s.post("/v1/completions", {"prompt": [1], "max_tokens": 1}, headers).status_code == 200
        )
        r = s.post("/v1/completions", {"prompt": [1], "max_tokens": 1}, {"Host": "gpu-box.lan"})
        assert_error(r, 401, "invalid_api_key")
        r = s.post(
            "/v1/completions",
            {"prompt": [1], "max_tokens": 1},
            {**headers, "Origin": "https://evil.example"},
        )
        assert_error(r, 403, "origin_not_allowed")
    finally:
        s.close()
