"""``.ci/setup.sh`` picks the MLX backend (issue 10 part 5), and pyproject's extras.

The script runs for real in a dry run (``TIERCHAT_SETUP_DRY_RUN=1``: prints the choice and
the commands, runs none); ``nvidia-smi`` and ``uname`` are faked by scripts put first on
PATH, so each machine kind is tested on this one.
"""

from __future__ import annotations

import os
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / ".ci" / "setup.sh"


def fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def dry_run(tmp_path: Path, *, system: str, gpu: str | None, backend: str = "") -> list[str]:
    """setup.sh's dry-run output lines on a faked machine. ``gpu``: what ``nvidia-smi -L``
    prints (exit 0), or None for an ``nvidia-smi`` that fails (no GPU, no driver)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake(bin_dir, "uname", f"echo {system}")
    fake(bin_dir, "nvidia-smi", f"echo '{gpu}'" if gpu is not None else "exit 9")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env["TIERCHAT_SETUP_DRY_RUN"] = "1"
    env.pop("TIERCHAT_BACKEND", None)
    if backend:
        env["TIERCHAT_BACKEND"] = backend
    proc = subprocess.run(
        ["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def pip_install(lines: list[str]) -> str:
    (line,) = [x for x in lines if x.startswith("+ python3 -m pip install -q -e ")]
    return line


def test_nvidia_gpu_gets_cuda(tmp_path):
    lines = dry_run(tmp_path, system="Linux", gpu="GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-x)")
    assert lines[0] == "backend=cuda extras=cuda,dev,demo"
    assert pip_install(lines).endswith(".[cuda,dev,demo]")
    assert not any("apt-get" in x for x in lines)


def test_linux_without_a_gpu_gets_cpu(tmp_path):
    lines = dry_run(tmp_path, system="Linux", gpu=None)
    assert lines[0] == "backend=cpu extras=cpu,dev,demo"
    assert pip_install(lines).endswith(".[cpu,dev,demo]")


def test_nvidia_smi_listing_no_gpu_is_cpu(tmp_path):
    lines = dry_run(tmp_path, system="Linux", gpu="No devices were found")
    assert lines[0].startswith("backend=cpu ")


def test_macos_gets_plain_mlx(tmp_path):
    lines = dry_run(tmp_path, system="Darwin", gpu=None)
    assert lines[0] == "backend=metal extras=dev,demo"
    assert pip_install(lines).endswith(".[dev,demo]")
    assert not any("apt-get" in x or "uninstall" in x for x in lines)


def test_override_and_bad_backend(tmp_path):
    lines = dry_run(tmp_path, system="Linux", gpu="GPU 0: NVIDIA H100", backend="cpu")
    assert lines[0].startswith("backend=cpu ")
    env = {**os.environ, "TIERCHAT_SETUP_DRY_RUN": "1", "TIERCHAT_BACKEND": "rocm"}
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "expected cpu, cuda or metal" in proc.stderr


def test_switching_backend_removes_the_other_first(tmp_path):
    """mlx-cpu and mlx-cuda-13 ship the same libmlx.so: the one present goes, the chosen
    one is reinstalled after (the uninstall took the shared file)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("mlx-cpu")
    except PackageNotFoundError:
        pytest.skip("needs mlx-cpu installed")
    lines = dry_run(tmp_path, system="Linux", gpu="GPU 0: NVIDIA H100")
    uninstall = lines.index("+ python3 -m pip uninstall -y -q mlx-cpu")
    install = lines.index(pip_install(lines))
    assert uninstall < install
    assert lines[-1].startswith(
        "+ python3 -m pip install -q --force-reinstall --no-deps mlx-cuda-13=="
    )


def test_pyproject_extras_pick_one_backend():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if "cpu" in d or "cuda" in d]
    (mlx,) = [d for d in project["dependencies"] if d.startswith("mlx==")]
    pin = mlx.removeprefix("mlx==")
    extras = project["optional-dependencies"]
    assert extras["cpu"] == [f"mlx[cpu]=={pin}"] and extras["cuda"] == [f"mlx[cuda13]=={pin}"]
