"""Issue 22 cases 5 and 6 on a real ``tierchat serve`` subprocess (tiny:llama): SIGTERM
during a stream ends it with an error event and ``[DONE]``, writes the SSD queue within
its bound and exits 0, and every entry on disk is loadable after a restart (the reply to
the same chat then comes from the SSD tier, equal to the first, cold, one); a second
process on the same cache dir refuses to start, naming the first."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from engine_kit import make_engine
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.app import create_app
from tierchat.core.serve.log import RequestLog, TrackedEngine
from tierchat.core.serve.server import ServerThread
from tierchat.core.serve.state import ServeState

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

CHAT = [{"role": "user", "content": "tell me about the quick brown fox " * 8}]


def serve_cmd(tmp: Path, models_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tierchat.cli.main",
        "serve",
        "--model",
        "tiny:llama",
        "--port",
        "0",
        "--cache-dir",
        str(tmp / "kv"),
        "--data-dir",
        str(tmp / "data"),
        "--models-dir",
        str(models_dir),
        "--block-size",
        "16",
        *extra,
    ]


def env_for(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCHAT_")}
    (tmp / "empty.toml").write_text("")
    env["TIERCHAT_CONFIG"] = str(tmp / "empty.toml")
    # write-through: these tests count the entries on disk while the server runs and after
    # its stop sequence (admission by reuse defers most writes to eviction or close)
    env["TIERCHAT_SSD_ADMISSION"] = "0"
    return env


class Process:
    """A ``tierchat serve`` subprocess; ``url`` once it listens; stderr collected."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: list[str] = []
        self.url = ""
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
            if m and not self.url:
                self.url = m.group(1)
                self._listening.set()
        self._listening.set()

    def wait_listening(self, timeout_s: float = 120) -> str:
        self._listening.wait(timeout_s)
        assert self.url, "".join(self.lines)
        return self.url

    def stderr(self) -> str:
        return "".join(self.lines)


def chat(url: str, stream: bool = False, max_tokens: int = 8) -> httpx.Response:
    body = {"messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_sigterm_during_a_stream_ends_it_and_keeps_every_entry(tmp_path, models_dir):
    server = Process(serve_cmd(tmp_path, models_dir, "--shutdown-s", "20"), env_for(tmp_path))
    try:
        url = server.wait_listening()
        first = chat(url)
        assert first.status_code == 200, first.text
        cold_text = first.json()["choices"][0]["message"]["content"]
        events: list[str] = []
        got_tokens = threading.Event()

        def stream() -> None:
            body = {
                "messages": CHAT
                + [
                    {"role": "assistant", "content": cold_text},
                    {"role": "user", "content": "and then? " * 20},
                ],
                "max_tokens": 3000,
                "temperature": 0,
                "stream": True,
            }
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) > 3:
                            got_tokens.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert got_tokens.wait(60), server.stderr()
        on_disk = sorted((tmp_path / "kv").glob("*/*/*.safetensors"))
        assert on_disk  # the first reply's entries were written before the signal
        server.proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert not reader.is_alive()
        assert server.proc.wait(60) == 0, server.stderr()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutting_down" and "SIGTERM" in error["message"]
    err = server.stderr()
    assert "SIGTERM: stopping" in err and "SSD entries written" in err
    assert "Traceback" not in err and "terminate called" not in err

    # restart on the same dir: every file there is indexed, verified and loadable
    engine = make_engine("tiny:llama", tmp_path, models_dir, cache_dir=tmp_path / "kv")
    try:
        ssd = engine.cache.ssd
        assert ssd.wait_verified(60)
        stats = engine.stats().ssd
        files = sorted((tmp_path / "kv").glob("*/*/*.safetensors"))
        assert set(on_disk) <= set(files) and stats.entries == len(files)
        assert stats.corrupt == 0 and not list((tmp_path / "kv").glob("*/*/*.tmp"))
        for path in on_disk:
            assert ssd.load(path.name.split(".")[0]) is not None, path
        tracked = TrackedEngine(engine, RequestLog())
        with ServerThread(
            create_app(ServeState(tracked, sampling=SamplingParams(max_tokens=8)))
        ) as again:
            r = chat(again.url)
            assert r.json()["choices"][0]["message"]["content"] == cold_text
            assert r.json()["usage"]["tierchat"]["cached_by"]["ssd"] > 0
    finally:
        engine.close()


def test_a_second_server_on_the_same_cache_dir_refuses(tmp_path, models_dir):
    env = env_for(tmp_path)
    first = Process(serve_cmd(tmp_path, models_dir), env)
    try:
        first.wait_listening()
        second = subprocess.run(
            serve_cmd(tmp_path, models_dir), capture_output=True, text=True, env=env, timeout=120
        )
        assert second.returncode == 1
        assert f"is in use by tierchat serve (pid {first.proc.pid})" in second.stderr
        assert "Traceback" not in second.stderr
        first.proc.send_signal(signal.SIGINT)
        assert first.proc.wait(60) == 0
        assert "SIGINT: stopping" in first.stderr()
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
    # the lock went with the process: a new server starts
    third = Process(serve_cmd(tmp_path, models_dir), env)
    try:
        third.wait_listening()
    finally:
        third.proc.send_signal(signal.SIGTERM)
        third.proc.wait(60)


def test_a_second_signal_exits_at_once(tmp_path, models_dir):
    server = Process(serve_cmd(tmp_path, models_dir, "--shutdown-s", "60"), env_for(tmp_path))
    try:
        url = server.wait_listening()
        assert chat(url).status_code == 200
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(30)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    err = server.stderr()
    assert code in (0, 128 + signal.SIGINT), err  # the first may have finished already
    assert "Traceback" not in err and "terminate called" not in err
