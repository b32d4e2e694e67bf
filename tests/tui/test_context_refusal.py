"""The real ``tierchat`` (tiny:llama, a 131,072-token context) in a tmux pane: a message
whose prompt cannot fit the context is refused at Enter with the numbers and a hint, and
nothing is prefilled or stored; the next normal message is answered as a cold run
(``tierchat replay --no-cache``) answers it."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
    pytest.mark.skipif(sys.platform == "win32", reason="needs a pty"),
]

TIMEOUT_S = 120.0
NORMAL = "the quick brown fox jumps over a lazy dog"


def _tmux(socket: str, *args: str) -> str:
    return subprocess.run(
        ["tmux", "-S", socket, *args], check=True, capture_output=True, text=True
    ).stdout


def _rows(db: Path, sql: str) -> list[tuple]:
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute(sql).fetchall()


def _env(tmp: Path) -> dict[str, str]:
    (tmp / "none.toml").write_text("")
    env = {
        "PYTHONPATH": os.pathsep.join(sys.path),
        "TERM": "xterm-256color",
        "TIERCHAT_CONFIG": str(tmp / "none.toml"),
    }
    if os.environ.get("TIERCHAT_MODELS_DIR"):
        env["TIERCHAT_MODELS_DIR"] = os.environ["TIERCHAT_MODELS_DIR"]
    return env


def test_a_prompt_past_the_context_is_refused_at_enter(tmp_path: Path) -> None:
    socket = str(tmp_path / "tmux.sock")
    db = tmp_path / "data" / "conversations.sqlite"
    flags = ["--model", "tiny:llama", "--cache-dir", str(tmp_path / "kv"), "--max-tokens", "8"]
    command = [sys.executable, "-m", "tierchat.cli.main", *flags, "--data-dir", str(db.parent)]
    env = _env(tmp_path)
    status = tmp_path / "status"
    shell = f"{shlex.join(command)}; echo $? > {shlex.quote(str(status))}"
    _tmux(socket, "-f", "/dev/null", "new-session", "-d", "-x", "120", "-y", "40",
          *(a for k, v in env.items() for a in ("-e", f"{k}={v}")), shell, ";",
          "set-option", "remain-on-exit", "on")  # fmt: skip

    def screen() -> str:
        return _tmux(socket, "capture-pane", "-p", "-t", "0")

    def until(predicate, what: str) -> str:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            assert not status.exists(), _tmux(socket, "capture-pane", "-p", "-S", "-")
            text = screen()
            if predicate(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}:\n{screen()}")

    try:
        until(lambda s: "is ready" in s, "the model to load")
        long_text = "many words " * 12300  # 135,300 characters: one token each on tiny:llama
        paste = tmp_path / "paste.txt"  # one bracketed paste (send-keys: a key per character)
        paste.write_text(long_text)
        _tmux(socket, "load-buffer", str(paste))
        _tmux(socket, "paste-buffer", "-p", "-t", "0")
        until(lambda s: "many words" in s.split("╭─")[-1], "the pasted text")
        _tmux(socket, "send-keys", "-t", "0", "Enter")
        shown = until(lambda s: "Cannot generate" in s, "the refusal")
        # the toast's lines: the text right of its "▌" edge, right border dropped
        toast = [ln.rsplit("▌", 1)[1].strip(" │") for ln in shown.splitlines() if "▌" in ln]
        flat = " ".join(" ".join(toast).split())
        assert "context is 131,072" in flat and "shorten the message" in flat, shown
        assert "tokens" in flat and "135,3" in flat, shown  # the prompt's own count
        # nothing was sent: no message stored, no prefill
        assert _rows(db, "SELECT count(*) FROM nodes")[0][0] == 0

        # the input kept the text; erase it, then a normal message
        _tmux(socket, "send-keys", "-t", "0", "C-l")  # clear the input
        until(lambda s: "many words" not in s.split("╭─")[-1], "the input to empty")
        _tmux(socket, "send-keys", "-t", "0", "-l", NORMAL)
        _tmux(socket, "send-keys", "-t", "0", "Enter")
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and not _rows(
            db, "SELECT content FROM nodes WHERE role = 'assistant'"
        ):
            assert not status.exists()
            time.sleep(0.2)
        replies = _rows(db, "SELECT content FROM nodes WHERE role = 'assistant'")
        assert len(replies) == 1, screen()
        (reply,) = replies
        users = _rows(db, "SELECT content FROM nodes WHERE role = 'user'")
        assert users == [(NORMAL,)]
    finally:
        if not status.exists():
            _tmux(socket, "send-keys", "-t", "0", "C-q")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not status.exists():
                time.sleep(0.1)
        subprocess.run(["tmux", "-S", socket, "kill-server"], capture_output=True)

    script = tmp_path / "cold.jsonl"
    script.write_text(
        json.dumps({"op": "new"}) + "\n" + json.dumps({"op": "user", "text": NORMAL}) + "\n"
    )
    models = ["--models-dir", env["TIERCHAT_MODELS_DIR"]] if "TIERCHAT_MODELS_DIR" in env else []
    cold = subprocess.run(
        [sys.executable, "-m", "tierchat.cli.main", "replay", str(script), *flags, *models,
         "--cache-dir", str(tmp_path / "kv-cold"), "--no-cache"],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=300,
    )  # fmt: skip
    assert cold.returncode == 0, cold.stderr
    assert json.loads(cold.stdout.splitlines()[0])["text"] == reply[0]
