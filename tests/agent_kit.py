"""The agent CLIs (Claude Code, Codex CLI, OpenCode) for tests and recordings: installed once
from npm at pinned versions, configured for a local base URL, run headless in a scratch
HOME with a time bound.

Versions and configs as in docs checked offline on this kind of machine
(/work/shared/agents/README.md): Claude Code speaks Anthropic Messages (``POST
/v1/messages?beta=true``), Codex CLI the OpenAI Responses API (``wire_api =
"responses"``), OpenCode chat completions through ``@ai-sdk/openai-compatible``.

:func:`install_clis` calls ``pytest.skip`` (with the reason) when ``node``/``npm`` is
missing or the install fails (no network, no npm cache): outside pytest that raises
``Skipped``, an exception like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

AgentName = Literal["claude-code", "codex", "opencode"]
AGENTS: tuple[AgentName, ...] = ("claude-code", "codex", "opencode")
PACKAGES = {
    "claude-code": "@anthropic-ai/claude-code@2.1.328",
    "codex": "@openai/codex@0.169.0",
    "opencode": "opencode-ai@1.18.33",
}
BIN_NAMES = {"claude-code": "claude", "codex": "codex", "opencode": "opencode"}
API_KEY = "local-key-not-checked"
# variables of a developer's own setup that would steer a CLI away from the base URL given
_DROPPED_ENV = ("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_", "OPENCODE_", "XDG_")


def cache_dir() -> Path:
    """``$TIERCHAT_AGENTS_DIR``, else ``~/.cache/tierchat-agents/<hash of the versions>``."""
    env = os.environ.get("TIERCHAT_AGENTS_DIR")
    if env:
        return Path(env).expanduser()
    digest = hashlib.sha256(" ".join(sorted(PACKAGES.values())).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "tierchat-agents" / digest


def install_clis(timeout_s: float = 600) -> dict[AgentName, Path]:
    """The three CLIs' executables, installed into :func:`cache_dir` on first use
    (``npm install --prefix``; later calls find them and run nothing). Skips the calling
    test when node or npm is missing or the install fails."""
    root = cache_dir()
    bins = {name: root / "node_modules" / ".bin" / BIN_NAMES[name] for name in AGENTS}
    if all(b.exists() for b in bins.values()):
        return bins
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"the agent CLIs need {tool}, which is not on PATH")
    root.mkdir(parents=True, exist_ok=True)
    cmd = ["npm", "install", "--prefix", str(root), "--no-audit", "--no-fund",
           *PACKAGES.values()]  # fmt: skip
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install of the agent CLIs took over {timeout_s:.0f} s (no network?)")
    missing = [str(b) for b in bins.values() if not b.exists()]
    if r.returncode != 0 or missing:
        tail = (r.stderr or r.stdout).strip()[-600:]
        pytest.skip(f"npm install of the agent CLIs failed (exit {r.returncode}): {tail}")
    return bins


@dataclass(frozen=True)
class Invocation:
    """One headless CLI run: the command, its environment and its working directory."""

    name: AgentName
    cmd: list[str]
    env: dict[str, str]
    cwd: Path


def scratch_home(home: Path) -> dict[str, str]:
    """An environment whose HOME and XDG dirs lie under ``home`` (created), so a run reads
    and writes nothing of the user's; the caller's PATH and locale are kept."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED_ENV)}
    env["HOME"] = str(home)
    for var, sub in (("XDG_CONFIG_HOME", ".config"), ("XDG_DATA_HOME", ".local/share"),
                     ("XDG_CACHE_HOME", ".cache"), ("XDG_STATE_HOME", ".local/state")):  # fmt: skip
        env[var] = str(home / sub)
        (home / sub).mkdir(parents=True, exist_ok=True)
    return env


def claude_env(base_url: str) -> dict[str, str]:
    """Claude Code's variables for a local Messages server at ``base_url`` (no ``/v1``)."""
    return {
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": API_KEY,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }


def write_codex_config(codex_home: Path, base_url: str, model: str = "local") -> Path:
    """``config.toml`` in ``codex_home`` pointing Codex at ``base_url`` over the Responses
    wire; the key is read from ``LOCAL_KEY``."""
    codex_home.mkdir(parents=True, exist_ok=True)
    path = codex_home / "config.toml"
    path.write_text(
        f"model = {json.dumps(model)}\n"
        'model_provider = "local"\n\n'
        "[model_providers.local]\n"
        'name = "local"\n'
        f"base_url = {json.dumps(base_url.removesuffix('/v1') + '/v1')}\n"
        'wire_api = "responses"\n'
        'env_key = "LOCAL_KEY"\n'
    )
    return path


def write_opencode_config(config_home: Path, base_url: str, model: str = "local") -> Path:
    """OpenCode's global ``opencode.json`` under ``config_home`` (``$XDG_CONFIG_HOME``):
    one OpenAI-compatible provider ``local`` at ``base_url`` and its one model."""
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "local",
        "options": {"baseURL": base_url.removesuffix("/v1") + "/v1", "apiKey": API_KEY},
        "models": {model: {"name": model}},
    }
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"local": provider},
        "model": f"local/{model}",
        "autoupdate": False,
        "share": "disabled",
    }
    path = config_home / "opencode" / "opencode.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))
    return path


def invocation(
    name: AgentName,
    bins: dict[AgentName, Path],
    base_url: str,
    workdir: Path,
    home: Path,
    task: str,
    model: str = "local",
) -> Invocation:
    """The headless run of ``name`` on ``task`` in ``workdir`` against ``base_url``, with its
    config written under the scratch ``home``. Claude Code may use Read and Bash; Codex runs
    in its read-only sandbox; OpenCode with its default tools."""
    env = scratch_home(home)
    exe = str(bins[name])
    if name == "claude-code":
        env.update(claude_env(base_url))
        cmd = [exe, "-p", task, "--model", model, "--allowedTools", "Read", "Bash"]
    elif name == "codex":
        codex_home = home / ".codex"
        write_codex_config(codex_home, base_url, model)
        env.update({"CODEX_HOME": str(codex_home), "LOCAL_KEY": API_KEY})
        cmd = [exe, "exec", "--skip-git-repo-check", "-s", "read-only", task]
    else:
        write_opencode_config(Path(env["XDG_CONFIG_HOME"]), base_url, model)
        cmd = [exe, "run", task]
    return Invocation(name, cmd, env, workdir)


def run_cli(run: Invocation, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """Runs ``run`` to its end, stdin closed; past ``timeout_s`` its whole process group is
    killed and the result has returncode -9 and what it had printed."""
    proc = subprocess.Popen(
        run.cmd,
        cwd=run.cwd,
        env={**run.env, "PWD": str(run.cwd)},  # OpenCode takes its project dir from $PWD
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[killed after {timeout_s:.0f} s]"
        return subprocess.CompletedProcess(run.cmd, -9, out, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(run.cmd, proc.returncode, out, err)
