"""Nothing lost under load, through HTTP (docs/DESIGN.md §20): sixteen clients at once on a
real ``tierchat serve`` subprocess (tiny:llama, its cache dir on disk), streaming and not,
their conversations mixing new turns, regenerates and edits, greedy and seeded sampling;
every reply equals the same request run alone on a cold server (``no_cache``, one request
at a time). After the server stops, every file of the SSD tier is verified and loadable;
after a restart each conversation's next turn restores its prefix from the SSD tier, with
replies still equal to the request alone."""

from __future__ import annotations

import json
import signal
import threading

import httpx
from engine_kit import make_engine
from test_serve_signals import Process, env_for, serve_cmd
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.app import create_app
from tierchat.core.serve.log import RequestLog, TrackedEngine
from tierchat.core.serve.server import ServerThread
from tierchat.core.serve.state import ServeState

CLIENTS = 16
MAX_TOKENS = 8
SYSTEM = "You answer questions about the quick brown fox and the lazy dog. " * 3


def ask(url: str, messages: list[dict], stream: bool, seed: int | None) -> dict:
    """One chat completion; ``{"text", "finish", "usage"}`` whether streamed or not."""
    body: dict = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    if seed is not None:
        body.update(temperature=0.8, seed=seed)
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        doc = r.json()
        choice = doc["choices"][0]
        return {
            "text": choice["message"]["content"],
            "finish": choice["finish_reason"],
            "usage": doc["usage"],
        }
    body.update(stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                parts.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return {"text": "".join(parts), "finish": finish, "usage": usage}


class Client:
    """One conversation: two turns, a regenerate, an edit of the first message, a turn
    after it; streaming on even clients, seeded sampling on every fourth."""

    def __init__(self, c: int) -> None:
        self.c = c
        self.stream = c % 2 == 0
        self.seed = 1000 + c if c % 4 == 3 else None
        self.sent: list[tuple[list[dict], dict]] = []  # (messages, reply)
        self.messages = [{"role": "system", "content": SYSTEM}]

    def turn(self, url: str, text: str) -> dict:
        self.messages.append({"role": "user", "content": text})
        reply = self.send(url, self.messages)
        self.messages.append({"role": "assistant", "content": reply["text"]})
        return reply

    def send(self, url: str, messages: list[dict]) -> dict:
        reply = ask(url, messages, self.stream, self.seed)
        assert reply["finish"] in ("stop", "length"), reply
        self.sent.append(([dict(m) for m in messages], reply))
        return reply

    def run(self, url: str) -> None:
        c = self.c
        self.turn(url, f"client {c}: where does the fox sleep {'?' * (c % 5 + 1)}")
        self.turn(url, f"and the dog, client {c}?")
        self.send(url, self.messages[:-1])  # regenerate the last reply
        edited = f"client {c}: where does the dog run {'!' * (c % 3 + 1)}"
        self.messages = [self.messages[0], {"role": "user", "content": edited}]
        self.send(url, self.messages)  # an edit of the first message: a new branch
        self.messages.append({"role": "assistant", "content": self.sent[-1][1]["text"]})
        self.turn(url, f"why, client {c}?")


def run_all(clients: list[Client], fn) -> None:
    errors: list[BaseException] = []

    def guarded(client: Client) -> None:
        try:
            fn(client)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def stop(server: Process) -> None:
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(120) == 0, server.stderr()
    err = server.stderr()
    assert "Traceback" not in err and "terminate called" not in err, err


def test_sixteen_clients_lose_nothing_and_restart_from_the_ssd_tier(tmp_path, models_dir):
    env = env_for(tmp_path)
    env.pop("TIERCHAT_SSD_ADMISSION")  # the default: entries wait for reuse, or the stop
    cmd = serve_cmd(tmp_path, models_dir, "--shutdown-s", "30", "--max-tokens", "64")
    clients = [Client(c) for c in range(CLIENTS)]
    server = Process(cmd, env)
    try:
        url = server.wait_listening()
        run_all(clients, lambda client: client.run(url))
        stop(server)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert all(len(client.sent) == 5 for client in clients)

    # the SSD tier after the stop: every file indexed, verified and loadable
    kv = tmp_path / "kv"
    files = sorted(kv.glob("*/*/*.safetensors"))
    assert files and not list(kv.glob("*/*/*.tmp"))
    engine = make_engine("tiny:llama", tmp_path, models_dir, cache_dir=kv)
    try:
        ssd = engine.cache.ssd
        assert ssd.wait_verified(60)
        stats = engine.stats().ssd
        assert stats.entries == len(files) and stats.corrupt == 0
        for path in files:
            assert ssd.load(path.name.split(".")[0]) is not None, path
    finally:
        engine.close()

    # the restart: every conversation's next turn, all at once, from what the tier kept
    server = Process(cmd, env)
    try:
        url = server.wait_listening()
        run_all(clients, lambda client: client.turn(url, f"and then, client {client.c}?"))
        stop(server)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    after = [client.sent[-1][1]["usage"] for client in clients]
    assert all(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in after), after
    assert sum(u["tierchat"]["cached_by"].get("ssd", 0) for u in after) > 0, after

    # every reply equals the same request run alone, cold, one at a time
    cold = TrackedEngine(
        make_engine("tiny:llama", tmp_path / "cold", models_dir, no_cache=True), RequestLog()
    )
    try:
        with ServerThread(
            create_app(ServeState(cold, sampling=SamplingParams(max_tokens=64), use_cache=False))
        ) as alone:
            for client in clients:
                for messages, reply in client.sent:
                    got = ask(alone.url, messages, client.stream, client.seed)
                    assert got["text"] == reply["text"], (client.c, messages)
                    assert got["finish"] == reply["finish"]
                    assert got["usage"]["completion_tokens"] == reply["usage"]["completion_tokens"]
    finally:
        cold.close()
    sampled = [r["text"] for cl in clients if cl.seed is not None for _, r in cl.sent]
    assert len(set(sampled)) > 1
