"""Nothing of a session lost (docs/DESIGN.md §8.4, §8.6) on a real ``tierchat serve``
subprocess (tiny:llama), admission on: ``kill -9`` once the write window has passed, then a
restart, restores the session from the SSD tier, its reply equal to a cold run's; SIGTERM
with more deferred than one write piece (a test hook lowers the piece bound) writes every
entry and exits 0."""

from __future__ import annotations

import signal
import sys
import time

import httpx
import pytest
from engine_kit import make_engine
from test_serve_signals import CHAT, Process, env_for, serve_cmd
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.app import create_app
from tierchat.core.serve.log import RequestLog, TrackedEngine
from tierchat.core.serve.server import ServerThread
from tierchat.core.serve.state import ServeState

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]

PIECE = 2048  # bytes: a layer's K/V of one 16-token block of tiny:llama is several pieces


def session_env(tmp, idle_s: float) -> dict[str, str]:
    env = env_for(tmp)
    env["TIERCHAT_SSD_ADMISSION"] = "1"  # deferred entries, as users run it
    env["TIERCHAT_SSD_FLUSH_IDLE_S"] = str(idle_s)
    env["TIERCHAT_TEST_SSD_PIECE_BYTES"] = str(PIECE)
    return env


def ask(url: str, messages, max_tokens: int = 8) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def writes(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()["ssd_writes"]


def cold_reply(tmp, models_dir, messages) -> str:
    """The same request on a cold engine (no cache), as serve runs it."""
    engine = make_engine("tiny:llama", tmp / "cold", models_dir, bitwise=False, no_cache=True)
    try:
        tracked = TrackedEngine(engine, RequestLog())
        with ServerThread(
            create_app(ServeState(tracked, sampling=SamplingParams(max_tokens=8)))
        ) as cold:
            return ask(cold.url, messages)["choices"][0]["message"]["content"]
    finally:
        engine.close()


def test_kill_9_after_the_window_then_a_restart_restores_the_session(tmp_path, models_dir):
    env = session_env(tmp_path, idle_s=0.5)
    server = Process(serve_cmd(tmp_path, models_dir), env)
    try:
        url = server.wait_listening()
        first = ask(url, CHAT)
        session = first["usage"]["prompt_tokens"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the window passes; the writer empties
            w = writes(url)
            if w["deferred"] == 0 and w["pending_bytes"] == 0 and w["session_bytes"] > 0:
                break
            time.sleep(0.1)
        assert w["deferred"] == 0 and w["pending_bytes"] == 0, w
        server.proc.kill()  # kill -9: no close, no flush
        assert server.proc.wait(60) == -signal.SIGKILL
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    turn2 = CHAT + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and then?"},
    ]
    again = Process(serve_cmd(tmp_path, models_dir), env)
    try:
        reply = ask(again.wait_listening(), turn2)
    finally:
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(60) == 0, again.stderr()
    cached = reply["usage"]["tierchat"]["cached_by"]
    assert cached["ssd"] >= session, (cached, session)
    assert reply["choices"][0]["message"]["content"] == cold_reply(tmp_path, models_dir, turn2)


def test_sigterm_writes_a_session_deferred_over_the_piece_bound(tmp_path, models_dir):
    env = session_env(tmp_path, idle_s=3600)  # everything still deferred at the signal
    server = Process(serve_cmd(tmp_path, models_dir, "--shutdown-s", "60"), env)
    messages = list(CHAT)
    try:
        url = server.wait_listening()
        out = ask(url, messages)
        for k in (1, 2):  # a session of three turns
            messages += [
                {"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"go on ({k})"},
            ]
            out = ask(url, messages)
        w = writes(url)
        assert w["deferred_bytes"] > 4 * PIECE, w
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(120) == 0, server.stderr()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    err = server.stderr()
    assert "SSD entries written" in err and "not saved" not in err, err
    assert "Traceback" not in err and "terminate called" not in err
    # a restart finds every file whole
    engine = make_engine(
        "tiny:llama", tmp_path, models_dir, bitwise=False, cache_dir=tmp_path / "kv"
    )
    try:
        assert engine.cache.ssd.wait_verified(60)
        stats = engine.stats().ssd
        assert stats.corrupt == 0 and stats.errors == 0 and stats.entries > 0
        assert not list((tmp_path / "kv").glob("*/*/*.tmp"))
    finally:
        engine.close()
    # and serve, started again, restores the session's last prompt whole from it (the
    # reply memory in the data dir splices the replies' ids back, as before the restart)
    again = Process(serve_cmd(tmp_path, models_dir), env)
    try:
        reply = ask(again.wait_listening(), messages)
    finally:
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(60) == 0, again.stderr()
    assert reply["usage"]["tierchat"]["cached_by"]["ssd"] >= out["usage"]["prompt_tokens"] - 1
    assert reply["choices"][0]["message"] == out["choices"][0]["message"]
