"""Memory bounded under concurrency, through HTTP (docs/DESIGN.md §11, §20): sixteen clients
send ~3,000-token prompts at once to a ``tierchat serve`` subprocess (tiny:llama) whose
``--memory-limit`` fits two to four of them at once. Every request is answered (200: the others
wait their turn, none is refused), the process's MLX peak stays within 1.1x the limit
(before: 166 MB under a 25 MB limit, every request admitted at once), and every reply
equals the same request sent alone to a fresh server. Then a prompt too large for the
limit is refused for good (400, no ``Retry-After``) and the next normal prompt passes
without a cache clear (before: every later prompt got 503 until ``cache clear``)."""

from __future__ import annotations

import threading

import httpx
from test_serve_signals import Process, env_for, serve_cmd

CLIENTS = 16
WORDS = 435  # ~2,900-3,400 tokens with tiny:llama's tokenizer
LIMIT = 35_000_000  # fits 2-4 of these prompts beside the weights and the SSD writer's bound


def prompt(i: int, words: int = WORDS) -> list[dict]:
    return [{"role": "user", "content": " ".join(f"w{i}x{j}" for j in range(words))}]


def ask(url: str, messages: list[dict]) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0.0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=600)


def memory(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()["memory"]


def serve(tmp, models_dir) -> Process:
    tmp.mkdir()
    cmd = serve_cmd(tmp, models_dir, "--memory-limit", str(LIMIT), "--max-tokens", "8")
    return Process(cmd, env_for(tmp))


def test_sixteen_prompts_under_a_tight_limit_all_answered_within_it(tmp_path, models_dir):
    server = serve(tmp_path / "a", models_dir)
    replies: dict[int, httpx.Response] = {}
    try:
        url = server.wait_listening()
        threads = [
            threading.Thread(target=lambda i=i: replies.__setitem__(i, ask(url, prompt(i))))
            for i in range(CLIENTS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = memory(url)

        # a prompt too large for the limit: refused at once, for good, saying so
        huge = ask(url, prompt(99, 12 * WORDS))
        assert huge.status_code == 400, huge.text
        assert "Retry-After" not in huge.headers
        error = huge.json()["error"]
        assert error["code"] == "insufficient_memory"
        assert "Waiting will not help" in error["message"], error
        # ... and the next prompt of the normal size passes, no cache clear between
        normal = ask(url, prompt(100))
        assert normal.status_code == 200, normal.text
    finally:
        server.proc.terminate()
        server.proc.wait(60)

    statuses = {i: r.status_code for i, r in replies.items()}
    assert statuses == dict.fromkeys(range(CLIENTS), 200), {
        i: r.text[:300] for i, r in replies.items() if r.status_code != 200
    }
    assert after["waited"] > 0  # they queued behind the memory line: not all held at once
    assert after["waiting"] == 0
    peak = after["process_peak_bytes"]
    assert 0 < peak <= 1.1 * LIMIT, f"peak {peak / 1e6:.1f} MB over 1.1 x {LIMIT / 1e6:.0f} MB"

    # each alone, one after another, on a fresh server of the same settings
    alone = serve(tmp_path / "b", models_dir)
    try:
        url = alone.wait_listening()
        for i in range(CLIENTS):
            r = ask(url, prompt(i))
            assert r.status_code == 200, r.text
            got = replies[i].json()["choices"][0]["message"]["content"]
            assert got == r.json()["choices"][0]["message"]["content"], i
    finally:
        alone.proc.terminate()
        alone.proc.wait(60)
