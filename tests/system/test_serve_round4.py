"""The server's defects of the console-and-server trial, round 4, against a real engine
(tiny:llama) behind the real app and uvicorn: clients that drop, ``Retry-After`` on every
503 and past the connection cap, parameters that change the reply and are not
implemented. Each case ends with a normal request answered as a cold run answers it."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import subprocess
import time

import httpx
import openai
import pytest
from test_serve_hostile import NORMAL, Served
from tierchat.core.engine.engine import Engine
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.app import create_app
from tierchat.core.serve.limits import ServeLimits
from tierchat.core.serve.log import RequestLog, TrackedEngine
from tierchat.core.serve.prompts import ReplyMemory
from tierchat.core.serve.server import ServerThread
from tierchat.core.serve.state import ServeState

DROP_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
)


@pytest.fixture
def served(tmp_path, models_dir):
    s = Served(tmp_path, models_dir)
    yield s
    s.close()


def wait_for(predicate, timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---------------------------------------------------------------- clients that drop


def test_a_client_that_drops_while_sending_its_body_is_one_log_line(served, capfd):
    capfd.readouterr()
    clients = [path for path in DROP_PATHS for _ in range(8)]
    for path in clients:
        c = socket.create_connection(("127.0.0.1", served.server.port))
        c.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            'Content-Length: 4000\r\n\r\n{"messages": [{"role": "user", '.encode()
        )
        time.sleep(0.05)  # the server is reading the body when the client goes
        c.close()
    seen: list[str] = []

    def logged() -> bool:
        seen.extend(capfd.readouterr().err.splitlines())
        return sum("closed its connection" in line for line in seen) >= len(clients)

    wait_for(logged, what="one line per dropped client")
    time.sleep(0.5)
    seen.extend(capfd.readouterr().err.splitlines())
    assert not any("Traceback" in line for line in seen), "\n".join(seen)
    drops = [line for line in seen if "closed its connection while sending its body" in line]
    assert len(drops) == len(clients), "\n".join(seen)
    assert len(seen) == len(clients), "\n".join(seen)  # nothing else for them
    for path in DROP_PATHS:
        assert sum(line.endswith(f"POST {path}") for line in drops) == 8
    served.still_normal()


# ---------------------------------------------------------------- Retry-After on every 503

BODIES = {
    "/v1/chat/completions": {"model": "m", "messages": NORMAL, "max_tokens": 4},
    "/v1/completions": {"model": "m", "prompt": "the quick brown fox", "max_tokens": 4},
    "/v1/messages": {"model": "m", "messages": NORMAL, "max_tokens": 4},
    "/v1/responses": {"model": "m", "input": "the quick brown fox", "max_output_tokens": 4},
}


def assert_503(r: httpx.Response, path: str, code: str) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) >= 1
    body = r.json()
    if path.startswith("/v1/messages"):  # Anthropic's shape
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    else:
        assert body["error"]["code"] == code and body["error"]["type"] == "server_error"


@pytest.mark.parametrize("cause", ["queue_full", "server_shutting_down", "model_not_loaded"])
def test_every_503_has_retry_after_in_every_apis_shape(served, tmp_path, cause):
    engine = served.engine
    if cause == "model_not_loaded":  # an engine with no model loaded yet
        engine = TrackedEngine(Engine(served.raw.settings), RequestLog())
    state = ServeState(
        engine, sampling=SamplingParams(max_tokens=4), max_queue=0 if cause == "queue_full" else 64
    )
    state.draining = cause == "server_shutting_down"
    try:
        with ServerThread(create_app(state)) as server:
            for path, body in BODIES.items():
                r = httpx.post(server.url + path, json=body, timeout=60)
                assert_503(r, path, cause)
    finally:
        if engine is not served.engine:
            engine.close()
    served.still_normal()


def test_past_the_connection_cap_a_request_gets_503_with_retry_after(tmp_path, models_dir):
    limits = ServeLimits(max_connections=4, header_timeout_s=120.0)
    s = Served(tmp_path, models_dir, limits)
    idle = []
    try:
        for _ in range(limits.max_connections):  # the cap, held by idle connections
            idle.append(socket.create_connection(("127.0.0.1", s.server.port)))
        time.sleep(0.5)
        for path, body in BODIES.items():
            r = httpx.post(s.url + path, json=body, timeout=60)  # a new connection each
            assert_503(r, path, "too_many_connections")
            assert r.headers["Connection"] == "close"
        # a raw client that sends a whole body reads the answer, not a reset
        c = socket.create_connection(("127.0.0.1", s.server.port))
        raw = json.dumps(BODIES["/v1/chat/completions"]).encode()
        c.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw)
        )
        c.settimeout(60)
        answer = b""
        while chunk := c.recv(65536):
            answer += chunk
        c.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        assert b"\r\nretry-after: " in answer.lower()
        for c in idle:
            c.close()
        idle.clear()
        time.sleep(0.5)
        s.still_normal()  # under the cap again: served
    finally:
        for c in idle:
            c.close()
        s.close()


# ---------------------------------------------------------------- parameters not implemented

CHAT = BODIES["/v1/chat/completions"]


@pytest.mark.parametrize(
    "param, value, neutral",
    [
        ("modalities", ["text", "audio"], ["text"]),
        ("audio", {"voice": "alloy", "format": "wav"}, None),
        ("prediction", {"type": "content", "content": "the quick brown fox"}, None),
        ("web_search_options", {}, None),
    ],
)
def test_parameters_that_change_the_reply_are_400_naming_them(served, param, value, neutral):
    r = served.post("/v1/chat/completions", {**CHAT, param: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter"
    assert param in error["message"]
    r = served.post("/v1/chat/completions", {**CHAT, param: neutral, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == served.cold


def test_assistant_tool_calls_in_the_history_are_accepted(served):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *NORMAL,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    r = served.post("/v1/chat/completions", {**CHAT, "messages": messages})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- reply memory on a full disk


def test_a_full_disk_cuts_no_reply_memory_line_and_is_said_once(served, monkeypatch, capfd):
    """The disk fills in the middle of a reply memory line (the first half written, then
    ENOSPC): replies go on, one warning is said, the file keeps whole lines only; when
    space is back the next reply is appended as a line of its own."""
    path = served.state.memory.path
    served.chat([{"role": "user", "content": "first, on a disk with room"}])
    assert path.read_text().count("\n") >= 1
    real_write = os.write
    full = {"on": True, "cut": 0}

    def write(fd: int, data) -> int:
        if full["on"] and os.fstat(fd).st_ino == path.stat().st_ino:
            full["cut"] += 1
            real_write(fd, bytes(data[: len(data) // 2]))  # half the line lands
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    capfd.readouterr()
    for i in range(3):
        reply = served.chat([{"role": "user", "content": f"on a full disk, {i}"}])
        assert reply  # serving goes on
    err = capfd.readouterr().err
    assert full["cut"] == 3
    assert err.count("reply memory") == 1 and "No space left" in err, err
    assert path.read_bytes().endswith(b"\n")
    full["on"] = False
    served.chat([{"role": "user", "content": "after space came back"}])
    lines = path.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # every line whole
    reloaded = ReplyMemory(256, path)
    assert len(lines) >= 2  # the first reply and the last
    assert len(reloaded) == len({json.loads(line)[0] for line in lines})
    assert "written again" in capfd.readouterr().err


def test_a_cut_last_line_is_dropped_on_load_so_the_next_append_is_whole(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(["kept", [1, 2]]) + "\n" + '["cut", [3,')
    memory = ReplyMemory(16, path)
    assert memory.lookup("kept") == (1, 2) and len(memory) == 1
    memory.remember(None, "next", [4, 5])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        ["kept", [1, 2]],
        ["next", [4, 5]],
    ]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs (root only: skipped where it cannot be mounted)."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_tmpfs_leaves_whole_reply_memory_lines(served, tiny_tmpfs, capfd):
    """The same on a real full file system: the reply memory's file has 24 bytes left in
    its last page and nothing else is free, so the next reply's line is cut by the disk."""
    path = tiny_tmpfs / "serve-replies" / "m.jsonl"
    state = ServeState(served.engine, sampling=SamplingParams(max_tokens=8), memory_path=path)
    with ServerThread(create_app(state)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        served.chat([{"role": "user", "content": "first, with room"}], client=client)
        size = path.stat().st_size
        pad = json.dumps(["pad", []])
        with open(path, "a") as f:  # whole lines up to 24 bytes short of a page
            while 4096 - (size % 4096) > 24 + len(pad) + 1 + 16:
                f.write(pad + "\n")
                size += len(pad) + 1
            room = 4096 - (size % 4096) - 24
            f.write(json.dumps(["p" * (room - len(json.dumps(["", []])) - 1), []]) + "\n")
        assert 4096 - path.stat().st_size % 4096 == 24
        with open(tiny_tmpfs / "filler", "wb", buffering=0) as f:  # every other page
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"x" * 4096)
        capfd.readouterr()
        for i in range(3):
            assert served.chat([{"role": "user", "content": f"full {i}"}], client=client)
        err = capfd.readouterr().err
        assert err.count("reply memory") == 1 and "No space left" in err, err
        assert path.read_bytes().endswith(b"\n")
        (tiny_tmpfs / "filler").unlink()
        served.chat([{"role": "user", "content": "after space came back"}], client=client)
        lines = path.read_text().splitlines()
        assert all(json.loads(line) for line in lines)
        assert json.loads(lines[-1])[0] != "pad"
