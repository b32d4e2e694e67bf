"""The CLI and a running TUI agree: the status file, clear requests, and ``tierchat cache``
against the real app (on the fake engine) in a pty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from fakes import FakeEngine
from tierchat.cli.main import main
from tierchat.core.files import write_atomic
from tierchat.core.live_status import (
    REQUESTS_DIR,
    STATUS_FILE,
    StatusWriter,
    read_status,
    request_clear,
    wait_cleared,
)


def test_status_round_trip_and_a_dead_pid_is_ignored(tmp_path):
    engine = FakeEngine("fake")
    try:
        writer = StatusWriter(tmp_path)
        assert writer.write("fake", engine.stats())
        status = read_status(tmp_path)
        assert status["pid"] == os.getpid() and status["model"] == "fake"
        assert status["stats"]["hot"]["max_bytes"] == engine.stats().hot.max_bytes
        first = (tmp_path / STATUS_FILE).stat().st_mtime_ns
        assert writer.write("fake", engine.stats())  # unchanged: not rewritten
        assert (tmp_path / STATUS_FILE).stat().st_mtime_ns == first
    finally:
        engine.close()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    StatusWriter(tmp_path, pid=dead.pid).write("gone", {"x": 1})
    assert read_status(tmp_path) is None
    assert read_status(tmp_path, check_pid=False)["model"] == "gone"


def test_status_folders_are_private_all_the_way_down(tmp_path):
    """The folders made for a status or request file are 0700, its missing parents too
    (``mkdir(parents=True)`` would leave them 0777 minus the umask)."""
    path = tmp_path / "cache" / REQUESTS_DIR / "clear-1.json"
    old = os.umask(0o022)
    try:
        write_atomic(path, {"tier": "hot"})
    finally:
        os.umask(old)
    assert json.loads(path.read_text()) == {"tier": "hot"}
    for d in (tmp_path / "cache", path.parent):
        assert d.stat().st_mode & 0o777 == 0o700, d


def test_clear_requests_are_served_once_and_answered(tmp_path):
    writer = StatusWriter(tmp_path)
    writer.write("m", {})
    rid = request_clear(tmp_path, "hot")
    (tmp_path / REQUESTS_DIR / "clear-bad.json").write_text("{not json")
    (request,) = writer.requests()  # the unreadable one is dropped
    assert request["tier"] == "hot" and request["id"] == rid

    def app_side():
        time.sleep(0.1)
        writer.served(request, "Cleared hot: hot −3 (12.0 KiB).")
        writer.write("m", {})

    threading.Thread(target=app_side).start()
    answer = wait_cleared(tmp_path, rid, timeout_s=5)
    assert answer["report"].startswith("Cleared hot")
    assert writer.requests() == []


def test_unanswered_request_is_withdrawn(tmp_path):
    StatusWriter(tmp_path).write("m", {})
    rid = request_clear(tmp_path, "ssd")
    assert wait_cleared(tmp_path, rid, timeout_s=0.2) is None
    assert not list((tmp_path / REQUESTS_DIR).glob("*.json"))


@pytest.mark.system  # the real app in a pty
@pytest.mark.usefixtures("isolated_settings")
def test_cache_commands_talk_to_the_running_app(tmp_path, capsys):
    """The real app in a pty; ``tierchat cache stats`` / ``clear`` in this process."""
    from test_terminal_keys import Terminal, replies

    term = Terminal(tmp_path)
    try:
        term.write(b"fill the cache with a longer message please\r")
        term.until(lambda: replies(term) == 1, "a reply")
        kv = str(tmp_path / "kv")

        def live_hot_entries() -> int:
            status = read_status(tmp_path / "kv")
            return status["stats"]["hot"]["entries"] if status else 0

        hot = term.until(live_hot_entries, "the status file to show the hot tier")
        assert main(["cache", "stats", "--cache-dir", kv, "--model", "never-loaded"]) == 0
        out = capsys.readouterr().out
        assert f"live figures from the running tierchat TUI (pid {term.proc.pid}" in out
        rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:] if line}
        assert rows["hot.entries"] == [str(hot)]
        assert rows["hot.max_bytes"] == ["64.0", "MiB"]  # binary units, as in the panels

        assert main(["cache", "stats", "--json", "--cache-dir", kv]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["source"]["pid"] == term.proc.pid and data["hot"]["entries"] == hot

        assert main(["cache", "clear", "hot", "--cache-dir", kv]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"Cleared hot: hot −{hot}") and "by the running tierchat TUI" in out
        term.until(lambda: live_hot_entries() == 0, "the app's own stats to show the clear")
    finally:
        term.close()
    assert read_status(tmp_path / "kv") is None  # the app removed its status file at exit
