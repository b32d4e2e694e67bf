"""The server's defects of the console-and-server trial, round 4, against a real engine
(tiny:llama) behind the real app and uvicorn: clients that drop, ``Retry-After`` on every
503 and past the connection cap, parameters that change the reply and are not
implemented. Each case ends with a normal request answered as a cold run answers it."""

from __future__ import annotations

import socket
import time

import pytest
from test_serve_hostile import Served

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
