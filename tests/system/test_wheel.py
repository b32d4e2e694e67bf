"""The wheel ships the whole app: built from the tree (``pip wheel``), installed into a
fresh venv, every module of it imports from the venv (not the tree), ``tierchat --help``
runs, ``serve`` answers on ``tiny:llama`` and the TUI mounts over the real engine (Pilot).

The venv sees this interpreter's site-packages for the dependencies (MLX, Textual, ...:
installing them again would download hundreds of MB); each imported module's file is
checked to lie in the venv, so a module missing from the wheel fails even where the
development (editable) install could still find it in the tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import httpx
import pytest
from test_serve_signals import Process, serve_cmd

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]

IMPORT_ALL = r"""
import importlib, sys, sysconfig
from pathlib import Path
purelib = Path(sysconfig.get_paths()["purelib"]).resolve()
names = sys.argv[1:]
outside = []
for name in names:
    try:
        mod = importlib.import_module(name)
    except ImportError as e:
        outside.append(f"{name}: {e}")
        continue
    f = getattr(mod, "__file__", None)
    if f is None or not Path(f).resolve().is_relative_to(purelib):
        outside.append(f"{name}: {f}")
print("modules", len(names))
if outside:
    print("NOT FROM THE WHEEL:", *outside, sep="\n  ")
    sys.exit(1)
"""


def tree_modules() -> list[str]:
    """Every module of the tree as its installed dotted name (``tui/services/background.py``
    -> ``tierchat.tui.services.background``), from pyproject's package-dir map."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    names = []
    for top, folder in setuptools["package-dir"].items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            if any(p.startswith(".") or p == "node_modules" for p in rel.parts):
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            names.append(".".join([top, *parts]))
    return names


MOUNT_TUI = r"""
import asyncio, sys, tempfile
from pathlib import Path
from tierchat.config.settings import Settings
from tierchat.core.chat.store import ConversationStore
from tierchat.core.engine.engine import Engine
from tierchat.core.sampling_params import SamplingParams
from tierchat.tui.app import TierchatApp

tmp = Path(tempfile.mkdtemp())
settings = Settings(model="tiny:llama", data_dir=tmp / "data", cache_dir=tmp / "kv",
                    models_dir=tmp / "models", block_size=16,
                    sampling=SamplingParams(max_tokens=4))

async def main():
    engine = Engine(settings)
    store = ConversationStore(":memory:")
    app = TierchatApp(engine, store, settings)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            for _ in range(600):
                await pilot.pause(0.1)
                if engine.model_name == "tiny:llama":
                    break
            print("screen", type(app.screen).__name__, "model", engine.model_name)
            assert engine.model_name == "tiny:llama"
    finally:
        engine.close()
        store.close()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A venv with the wheel built from this tree installed (no deps: they come from this
    interpreter's site-packages). Returns the venv's dir."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    out = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        check=True,
        timeout=300,
    )
    (wheel,) = out.glob("tierchat-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    return env_dir


def run_in(env_dir: Path, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}:{env['PATH']}"
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, cwd=env_dir, env=env
    )


def test_every_module_of_the_wheel_imports_from_the_venv(wheel_venv):
    proc = run_in(
        wheel_venv, [str(wheel_venv / "bin" / "python"), "-c", IMPORT_ALL, *tree_modules()]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert int(proc.stdout.split()[1]) == len(tree_modules()) > 50


def test_the_installed_command_runs_and_the_tui_mounts(wheel_venv):
    proc = run_in(wheel_venv, [str(wheel_venv / "bin" / "tierchat"), "--help"])
    assert proc.returncode == 0 and "serve" in proc.stdout, proc.stderr
    proc = run_in(wheel_venv, [str(wheel_venv / "bin" / "python"), "-c", MOUNT_TUI])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "model tiny:llama" in proc.stdout


def test_the_installed_serve_answers_a_chat(wheel_venv, tmp_path, models_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERCHAT_", "PYTHON"))}
    (tmp_path / "empty.toml").write_text("")
    env["TIERCHAT_CONFIG"] = str(tmp_path / "empty.toml")
    # the same flags as the serve tests, run by the venv's own command
    args = serve_cmd(tmp_path, models_dir)[serve_cmd(tmp_path, models_dir).index("serve") :]
    server = Process([str(wheel_venv / "bin" / "tierchat"), *args], env)
    try:
        url = server.wait_listening()
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.stderr()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
