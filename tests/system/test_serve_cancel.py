"""A client that disconnects frees the engine within one step (docs/DESIGN.md §20), streaming
or not, on the real engine (tiny model) behind a real server.

Deterministic: the client's socket is closed from the request log's listener on the engine
thread at the reply's first token, and that thread waits there until the server has seen
the disconnect (the record turns "stopping"); the next step must end the reply, so it
has exactly one token."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest
from engine_kit import make_engine
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.app import create_app
from tierchat.core.serve.log import RequestLog, TrackedEngine
from tierchat.core.serve.server import ServerThread
from tierchat.core.serve.state import ServeState


class Served:
    """A real engine on ``model`` behind a server on a free loopback port."""

    def __init__(self, model: str, tmp: Path, models_dir: Path, **kw):
        self.engine = TrackedEngine(make_engine(model, tmp, models_dir), RequestLog())
        self.state = ServeState(self.engine, **kw)
        self.server = ServerThread(create_app(self.state)).start()
        self.client = openai.OpenAI(
            base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=120
        )

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


def _post(url: str, body: dict) -> socket.socket:
    u = urlparse(url)
    raw = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=60)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    sock.sendall(head.encode() + raw)
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streaming"])
def test_a_client_that_disconnects_is_cancelled_at_the_next_step(stream, tmp_path, models_dir):
    served = Served("tiny:llama", tmp_path, models_dir, sampling=SamplingParams(max_tokens=400))
    try:
        log = served.state.engine.log
        sock_box: list[socket.socket] = []
        stopping = threading.Event()
        closed = threading.Event()

        def listener(record) -> None:
            if record.status == "stopping":
                stopping.set()
            elif record.phase == "decoding" and not closed.is_set() and sock_box:
                closed.set()
                sock_box[0].close()
                assert stopping.wait(60), "the server never saw the disconnect"

        log.subscribe(listener)
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "tell me a long story " * 4}],
            "max_tokens": 400,
            "stream": stream,
        }
        sock_box.append(_post(served.server.url, body))
        assert closed.wait(120) and stopping.wait(120)

        def ended() -> bool:
            return log.snapshot().records[0].status in ("cancelled", "done")

        done = threading.Event()
        log.subscribe(lambda r: ended() and done.set())
        assert ended() or done.wait(120)
        record = log.snapshot().records[0]
        assert record.status == "cancelled"
        assert record.metrics.generation_tokens == 1  # left at the step after the close
        # the engine is free: the next request runs
        r = served.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert r.choices[0].finish_reason in ("length", "stop")
    finally:
        served.close()
