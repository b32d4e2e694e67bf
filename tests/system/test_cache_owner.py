"""One owner per cache dir (issue 22 case 5): the lock, the refusal of a second engine
process, and ``tierchat cache stats|clear`` acting on a running ``tierchat chat``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from tierchat.cli.main import main
from tierchat.core.cache.dir_lock import CacheDirBusy, acquire_dir, dir_owner, release_dir
from tierchat.core.live_status import read_status

HOLDER = textwrap.dedent(
    """
    import sys, time
    from tierchat.core.cache.dir_lock import acquire_dir
    acquire_dir(sys.argv[1], command="tierchat serve")
    print("locked", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def other_owner(tmp_path):
    """Another process holding ``tmp_path / "kv"``."""
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(kv)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    yield kv, proc
    proc.kill()
    proc.wait()


def test_the_lock_is_per_process_and_names_its_owner(other_owner):
    kv, proc = other_owner
    assert dir_owner(kv) == {"pid": proc.pid, "command": "tierchat serve"}
    with pytest.raises(CacheDirBusy, match=f"in use by tierchat serve \\(pid {proc.pid}\\)"):
        acquire_dir(kv)
    assert (kv / "lock").stat().st_mode & 0o777 == 0o600
    proc.kill()
    proc.wait()
    assert dir_owner(kv) is None  # the lock went with the process
    acquire_dir(kv)
    acquire_dir(kv)  # engines of one process share it
    assert dir_owner(kv) is None
    release_dir(kv)
    release_dir(kv)


@pytest.mark.usefixtures("isolated_settings")
@pytest.mark.parametrize("command", ["chat", "replay", "serve"])
def test_a_second_engine_process_refuses_a_owned_dir(other_owner, tmp_path, capsys, command):
    kv, proc = other_owner
    script = tmp_path / "s.jsonl"
    script.write_text('{"op": "user", "text": "hi"}\n')
    args = {"chat": ["chat"], "replay": ["replay", str(script)], "serve": ["serve", "--port", "0"]}
    code = main([*args[command], "--model", "tiny:llama", "--cache-dir", str(kv)])
    err = capsys.readouterr().err
    assert code == 1
    assert f"in use by tierchat serve (pid {proc.pid})" in err and "--cache-dir" in err
    assert "Traceback" not in err


@pytest.mark.usefixtures("isolated_settings")
def test_cache_commands_act_on_a_running_line_chat(tmp_path, models_dir, capsys):
    kv = tmp_path / "kv"
    (tmp_path / "empty.toml").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCHAT_")}
    env["TIERCHAT_CONFIG"] = str(tmp_path / "empty.toml")
    cmd = [sys.executable, "-m", "tierchat.cli.main", "chat", "--model", "tiny:llama"]
    cmd += ["--cache-dir", str(kv), "--data-dir", str(tmp_path / "data")]
    cmd += ["--models-dir", str(models_dir), "--block-size", "16", "--max-tokens", "8"]
    chat = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        chat.stdin.write("tell me about the quick brown fox and the lazy dog\n")
        chat.stdin.flush()
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline:
            status = read_status(kv)
            if status and status["stats"]["hot"]["entries"] > 0:
                break
            time.sleep(0.1)
        assert status and status["process"] == "chat" and status["pid"] == chat.pid
        hot = status["stats"]["hot"]["entries"]
        assert main(["cache", "stats", "--json", "--cache-dir", str(kv)]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["source"]["process"] == "chat" and data["hot"]["entries"] == hot
        assert main(["cache", "clear", "hot", "--cache-dir", str(kv)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"Cleared hot: hot −{hot}")
        assert f"\n  by the running tierchat chat (pid {chat.pid}" in out
        out, err = chat.communicate("/stats\n", timeout=120)
    finally:
        if chat.poll() is None:
            chat.kill()
    assert chat.returncode == 0, err
    assert "[hot  0 entries" in out  # the chat's own engine was cleared
    assert read_status(kv) is None  # its status file went with it
