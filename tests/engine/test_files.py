"""Temp files of builds killed at any point (core/files.py): the next start removes them,
a live build's are kept, and the model picker never offers a temp directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from tierchat.core.files import LEGACY_TEMP_AGE_S, remove_stale_temps, staged_dir, temp_file
from tierchat.tui.models import model_choices

HERE = Path(__file__).resolve().parent

# The demo's first start, in a child process: `_convert` assembles a GGUF into a temp
# file, then `convert_gguf` builds the MLX directory in a staged temp dir. The child
# stops at the point named in argv[3] ("AT <point>" on stdout) and waits to be killed.
CHILD = textwrap.dedent(
    """
    import shutil, sys, time
    from pathlib import Path
    from tierchat.core.models import loading as models

    source, target, point = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

    def stop(at):
        if at == point:
            print("AT", at, flush=True)
            time.sleep(120)

    def assemble(path):
        stop("assembling")  # the temp GGUF exists, still empty
        shutil.copyfile(source, path)
        stop("assembled")

    def progress(done, total, message):
        if message == "building tokenizer":
            stop("tokenizer")  # the staged dir exists, empty
        elif message.startswith("dequantizing") and done == 2:
            stop("tensors")  # config.json and a half-written model.safetensors
        elif message == "finishing":
            stop("finishing")  # everything written, not yet renamed

    models._convert("demo", assemble, target, progress)
    print("DONE", flush=True)
    """
)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    sys.path.insert(0, str(HERE))
    from test_models import _write_tiny_qwen2_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_tiny_qwen2_gguf(path, np.random.default_rng(0))
    return path


def start_child(source: Path, models_dir: Path, point: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(source), str(models_dir / "demo"), point],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    if line.strip() != f"AT {point}":
        proc.kill()
        raise AssertionError(f"the child did not reach {point}: {line!r} {proc.stderr.read()}")
    return proc


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.system  # a child process per point, killed
@pytest.mark.parametrize("point", ["assembling", "assembled", "tokenizer", "tensors", "finishing"])
def test_a_conversion_killed_at_any_point_leaves_nothing_after_the_next_start(
    tiny_gguf, tmp_path, point
):
    models_dir = tmp_path / "models"
    proc = start_child(tiny_gguf, models_dir, point)
    try:
        left = temps(models_dir)
        assert any(n.startswith(f".demo.tmp-{proc.pid}-") and n.endswith(".gguf") for n in left)
        if point in ("tokenizer", "tensors", "finishing"):
            staged = [n for n in left if not n.endswith(".gguf")]
            assert len(staged) == 1 and staged[0].startswith(f".demo.tmp-{proc.pid}-")
        # while the build runs, its files are its own: a start beside it keeps them
        assert remove_stale_temps(models_dir) == []
        assert temps(models_dir) == left
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    assert temps(models_dir) == left  # a killed process cleans nothing up
    if point in ("tensors", "finishing"):
        staged = models_dir / next(n for n in left if not n.endswith(".gguf"))
        assert (staged / "config.json").is_file() and (staged / "model.safetensors").is_file()
    # the picker never offers the half-built directory, before or after the clean-up
    offered = [c.spec for c in model_choices(models_dir, test_models=True)]
    assert not [s for s in offered if ".tmp-" in s]
    assert not (models_dir / "demo").exists()

    # the next start: resolving any model cleans the models dir first
    from tierchat.core.models.loading import resolve_model_dir

    resolve_model_dir("tiny:llama", models_dir)
    assert temps(models_dir) == []
    assert sorted(p.name for p in models_dir.iterdir()) == ["tiny-llama-0"]


def test_an_interrupted_build_in_this_process_cleans_up_after_itself(tmp_path):
    target = tmp_path / "m"
    with pytest.raises(RuntimeError), staged_dir(target, lambda d: d.exists()) as tmp:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("stopped")
    with pytest.raises(RuntimeError), temp_file(target, ".gguf") as path:
        path.write_bytes(b"GGUF")
        raise RuntimeError("stopped")
    assert list(tmp_path.iterdir()) == []


def test_a_complete_build_is_never_replaced_by_a_concurrent_one(tmp_path):
    """Two builders of one target (parallel test workers sharing a models dir): the one
    that publishes second keeps the first one's directory instead of removing it under
    its readers. Right after builder A found no target, B (started there) tries to
    publish; A goes on after B finished or 1 s (B waits on the folder lock till A is done)."""
    import threading

    target = tmp_path / "m"
    b_done = threading.Event()
    seen: dict[str, int] = {}
    errors: list[BaseException] = []

    def complete(d: Path) -> bool:
        return (d / "model.safetensors").exists()

    def build(name: str, on_check=None) -> None:
        def done(d: Path) -> bool:
            answer = complete(d)
            if on_check is not None:  # between the check and what follows from it
                on_check()
            return answer

        try:
            with staged_dir(target, done) as tmp:
                (tmp / "model.safetensors").write_text(name)
            seen[name] = target.stat().st_ino
        except BaseException as e:  # noqa: B036  (re-raised in the test's thread)
            errors.append(e)

    def start_b() -> None:
        b = threading.Thread(target=lambda: (build("B"), b_done.set()))
        b.start()
        b_done.wait(timeout=1.0)  # unlocked, B would publish now; locked, it waits for A

    a = threading.Thread(target=build, args=("A", start_b))
    a.start()
    a.join(timeout=60)
    assert b_done.wait(timeout=60) and not errors, errors
    assert seen["A"] == seen["B"] == target.stat().st_ino  # one directory, never replaced
    assert (target / "model.safetensors").read_text() == "A"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp dir or lock file left


def test_temps_without_a_pid_go_by_age_and_other_names_are_never_touched(tmp_path):
    old = time.time() - LEGACY_TEMP_AGE_S - 60
    legacy_file = tmp_path / ".demo-k3j2h1g0.gguf"  # as builds before the pid wrote them
    legacy_dir = tmp_path / ".demo.tmp-ab_cd123"
    fresh_dir = tmp_path / ".demo-gemma.tmp-zz9yy8xx"
    legacy_file.write_bytes(b"GGUF")
    legacy_dir.mkdir()
    (legacy_dir / "model.safetensors").write_bytes(b"x")
    fresh_dir.mkdir()
    for path in (legacy_file, legacy_dir, legacy_dir / "model.safetensors"):
        os.utime(path, (old, old))
    keep = [tmp_path / "demo", tmp_path / ".cache", tmp_path / ".demo.tmp-notes.txt"]
    keep[0].mkdir()
    keep[1].mkdir()
    keep[2].write_text("mine")
    removed = remove_stale_temps(tmp_path)
    assert sorted(removed) == sorted([legacy_file, legacy_dir])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [fresh_dir.name] + [p.name for p in keep]
    )
    # a legacy dir whose file is still being written is not old, whatever its own mtime
    os.utime(fresh_dir, (old, old))
    (fresh_dir / "model.safetensors").write_bytes(b"still writing")
    assert remove_stale_temps(tmp_path) == []
