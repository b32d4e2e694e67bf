"""Helpers of the fault tests (tests/system/test_faults.py): ``tierchat replay`` and ``tierchat
serve`` as real subprocesses on tiny models, with a tmp cache, data and empty config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tierchat.core.sampling_params import SamplingParams


def env_for(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a subprocess: no TIERCHAT_* of ours (but the models dir), an
    empty config file, plus ``extra`` (``TIERCHAT_...`` settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCHAT_")}
    (tmp / "empty.toml").write_text("")
    env["TIERCHAT_CONFIG"] = str(tmp / "empty.toml")
    env.update(extra)
    return env


def common_flags(
    tmp: Path, models_dir: Path, model: str = "tiny:llama", tag: str = ""
) -> list[str]:
    return [
        "--model",
        model,
        "--block-size",
        "16",
        "--cache-dir",
        str(tmp / f"kv{tag}"),
        "--data-dir",
        str(tmp / f"data{tag}"),
        "--models-dir",
        str(models_dir),
    ]


def write_script(path: Path, ops: list[dict]) -> Path:
    path.write_text("".join(json.dumps(op) + "\n" for op in ops))
    return path


@dataclass
class ReplayRun:
    code: int
    lines: list[dict]
    stderr: str

    @property
    def results(self) -> list[dict]:
        return [x for x in self.lines if "op_index" in x]

    def by_index(self) -> dict[int, dict]:
        return {x["op_index"]: x for x in self.results}

    @property
    def summary(self) -> dict:
        return next(x["summary"] for x in self.lines if "summary" in x)


def replay_cmd(script: Path, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "tierchat.cli.main", "replay", str(script), *flags]


def run_replay(
    script: Path, flags: list[str], env: dict[str, str], timeout_s: float = 600
) -> ReplayRun:
    """``tierchat replay SCRIPT FLAGS`` to its end (``timeout_s`` fails the test)."""
    p = subprocess.run(
        replay_cmd(script, flags), capture_output=True, text=True, env=env, timeout=timeout_s
    )
    assert "Traceback" not in p.stderr, p.stderr
    return ReplayRun(p.returncode, [json.loads(x) for x in p.stdout.splitlines()], p.stderr)


NORMAL = [{"role": "user", "content": "the quick brown fox jumps over a lazy dog"}]


class ColdReference:
    """Replies of a cold run (the real engine in this process, ``use_cache=False``,
    behind the same HTTP app as ``tierchat serve``) on ``model``."""

    def __init__(self, tmp: Path, models_dir: Path, model: str = "tiny:llama") -> None:
        from engine_kit import make_engine
        from tierchat.core.serve.app import create_app
        from tierchat.core.serve.log import RequestLog, TrackedEngine
        from tierchat.core.serve.server import ServerThread
        from tierchat.core.serve.state import ServeState

        self.engine = TrackedEngine(make_engine(model, tmp, models_dir), RequestLog())
        state = ServeState(self.engine, sampling=SamplingParams(max_tokens=8), use_cache=False)
        self.server = ServerThread(create_app(state)).start()
        self.url = self.server.url

    def chat(self, messages: list[dict], max_tokens: int = 8) -> str:
        return chat_text(self.url, messages, max_tokens)

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


def chat_body(messages: list[dict], max_tokens: int = 8, **kw) -> dict:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}


def chat_text(url: str, messages: list[dict], max_tokens: int = 8, client=None) -> str:
    import httpx

    post = (client or httpx).post
    r = post(url + "/v1/chat/completions", json=chat_body(messages, max_tokens), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]
