"""The real ``tierchat`` in a default terminal: 80×24, started as a user starts it.

A tmux pane of 80 columns and 24 rows runs the installed command (the real engine on
``tiny:llama``) with no ``COLUMNS``/``LINES`` hints, so the app reads its size from the
terminal as it does for a user. Before the fix, the first layout put the conversation
list, the chat and the cache panels side by side at 80 columns, left the input four cells
wide, and Textual's ``TextArea`` raised while wrapping its placeholder: the app exited at
start with a traceback (status 0).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
    pytest.mark.skipif(sys.platform == "win32", reason="needs a pty"),
]

STARTED_S = 10.0  # the check: the app is still running this long after start


def _tmux(socket: str, *args: str) -> str:
    return subprocess.run(
        ["tmux", "-S", socket, *args], check=True, capture_output=True, text=True
    ).stdout


@pytest.mark.parametrize("size", [(80, 24), (80, 40)])
def test_tierchat_starts_and_keeps_running_at_80_columns(tmp_path: Path, size) -> None:
    cols, rows = size
    socket = str(tmp_path / "tmux.sock")
    exe = shutil.which("tierchat")
    command = [exe] if exe else [sys.executable, "-m", "tierchat.cli.main"]
    command += [
        "--model",
        "tiny:llama",
        "--data-dir",
        str(tmp_path / "data"),
        "--cache-dir",
        str(tmp_path / "kv"),
    ]
    env = {
        "PYTHONPATH": os.pathsep.join(sys.path),
        "TERM": "xterm-256color",
        "TIERCHAT_CONFIG": str(tmp_path / "none.toml"),
    }
    if os.environ.get("TIERCHAT_MODELS_DIR"):
        env["TIERCHAT_MODELS_DIR"] = os.environ["TIERCHAT_MODELS_DIR"]
    (tmp_path / "none.toml").write_text("")
    flags = [a for key, value in env.items() for a in ("-e", f"{key}={value}")]
    # the exit status lands in a file, so a crash is told apart from a running app
    status = tmp_path / "status"
    shell = f"{shlex.join(command)}; echo $? > {shlex.quote(str(status))}"
    _tmux(socket, "-f", "/dev/null", "new-session", "-d", "-x", str(cols), "-y", str(rows),
          *flags, shell, ";", "set-option", "remain-on-exit", "on")  # fmt: skip
    try:
        # started: the input's placeholder is on the screen (the model may still load)
        deadline = time.monotonic() + 60
        screen = ""
        while time.monotonic() < deadline and "Message…" not in screen:
            assert not status.exists(), _tmux(socket, "capture-pane", "-p", "-S", "-")
            time.sleep(0.25)
            screen = _tmux(socket, "capture-pane", "-p", "-t", "0")
        assert "Message…" in screen, screen
        time.sleep(STARTED_S)
        screen = _tmux(socket, "capture-pane", "-p", "-t", "0")
        assert not status.exists(), _tmux(socket, "capture-pane", "-p", "-S", "-")
        dead = _tmux(socket, "list-panes", "-t", "0", "-F", "#{pane_dead}").strip()
        assert dead == "0"
        # the narrow layout: the list beside the chat, the panels folded into one line
        assert "Conversations" in screen
        assert "cache (F2)" in screen
        lines = screen.splitlines()
        assert len(lines) <= rows and all(len(line) <= cols for line in lines)
    finally:
        subprocess.run(["tmux", "-S", socket, "kill-server"], capture_output=True)
