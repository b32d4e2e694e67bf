"""The ``tierchat`` command line: flags, subcommands, and errors as one stderr line.

In-process through ``main(argv)`` on ``tiny:llama`` (block size 16, tmp dirs); one
subprocess test checks the real entry point prints no traceback.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_kit import generate, make_engine, random_prompt
from tierchat.cli.main import main

pytestmark = pytest.mark.usefixtures("isolated_settings")


@pytest.fixture
def tiny(tmp_path, models_dir) -> list[str]:
    return [
        "--model",
        "tiny:llama",
        "--block-size",
        "16",
        "--cache-dir",
        str(tmp_path / "kv"),
        "--data-dir",
        str(tmp_path / "data"),
        "--models-dir",
        str(models_dir),
    ]


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return code, out, err


def write(path: Path, ops: list[dict]) -> str:
    path.write_text("".join(json.dumps(op) + "\n" for op in ops))
    return str(path)


# ------------------------------------------------------------------ errors


def test_unknown_model(capsys, tiny):
    code, out, err = run(capsys, ["cache", "stats", *tiny, "--model", "no-such-model"])
    assert code == 1 and out == ""
    assert err.startswith("error: unknown model 'no-such-model'") and err.count("\n") == 1


@pytest.mark.parametrize(
    "flag, value, key",
    [
        ("--block-size", "0", "block_size"),
        ("--block-size", "abc", "block_size"),
        ("--hot-bytes", "lots", "hot_bytes"),
        ("--memory-limit", "-5GB", "memory_limit"),
        ("--max-tokens", "-1", "max_tokens"),
    ],
)
def test_invalid_setting(capsys, tiny, flag, value, key):
    code, out, err = run(capsys, ["config", *tiny, f"{flag}={value}"])
    assert code == 2 and out == ""
    assert err.startswith(f"error: {key} = ") and f"(from cli {flag})" in err
    assert err.count("\n") == 1


def test_memory_limit_accepts_units(capsys, tiny):
    code, out, _ = run(capsys, ["config", *tiny, "--memory-limit", "6GB"])
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("memory_limit"))
    assert "6000000000" in row and "cli --memory-limit" in row


def test_usage_error_exit_2(capsys):
    code = main(["cache", "clear", "l2"])
    assert code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("chat", "replay", "models", "cache", "config", "bench"):
        assert command in out


def test_unwritable_cache_dir_warns_and_works(capsys, tiny, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    script = write(tmp_path / "s.jsonl", [{"op": "user", "text": "hello", "max_tokens": 3}])
    code, out, err = run(capsys, ["replay", script, *tiny, "--cache-dir", str(blocker / "kv")])
    assert code == 0
    assert "warning:" in err and "not writable" in err
    result = json.loads(out.splitlines()[0])
    assert result["generation_tokens"] == 3


def test_unwritable_data_dir_is_an_error(capsys, tiny, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code, out, err = run(capsys, ["chat", *tiny, "--data-dir", str(blocker / "data")])
    assert code == 1
    assert err.startswith("error: cannot open the conversation store") and "--data-dir" in err


def test_missing_config_file(capsys, tmp_path):
    code, _, err = run(capsys, ["config", "--config", str(tmp_path / "none.toml")])
    assert code == 2 and "does not exist" in err


def test_entry_point_in_a_subprocess(tmp_path):
    """The real entry point: a missing script is one line, exit 2, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCHAT_")}
    env["TIERCHAT_CONFIG"] = str(tmp_path / "empty.toml")
    (tmp_path / "empty.toml").write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "tierchat.cli.main", "replay", str(tmp_path / "x.jsonl")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == f"error: {tmp_path / 'x.jsonl'}: no such file\n"
    assert "mlx" not in proc.stdout


# ------------------------------------------------------------------ subcommands


def test_models(capsys, tiny):
    code, out, _ = run(capsys, ["models", *tiny])
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["model", "available"]
    names = [line.split()[0] for line in lines[1:]]
    assert {"demo", "demo-gemma", "tiny:llama", "tiny:mamba2"} <= set(names)


def test_config_shows_sources(capsys, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TIERCHAT_SSD_BYTES", "1GB")
    code, out, _ = run(capsys, ["config", *tiny])
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert rows["block_size"].split()[1:] == ["16", "cli", "--block-size"]
    assert rows["ssd_bytes"].split()[1:] == ["1000000000", "env", "TIERCHAT_SSD_BYTES"]
    assert rows["top_p"].split()[1:] == ["1.0", "default"]


def test_flags_before_and_after_the_subcommand(capsys, tiny):
    code, out, _ = run(capsys, ["--block-size", "32", "config", "--seed", "7"])
    assert code == 0
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:]}
    assert rows["block_size"] == "32" and rows["seed"] == "7"


def test_cache_stats_and_clear(capsys, tiny, tmp_path):
    ops = [{"op": "user", "text": "fill a few blocks of the cache please", "max_tokens": 4}]
    assert run(capsys, ["replay", write(tmp_path / "s.jsonl", ops), *tiny])[0] == 0

    code, out, _ = run(capsys, ["cache", "stats", "--json", *tiny])
    assert code == 0
    stats = json.loads(out)
    assert stats["model"] == "tiny:llama" and stats["block_size"] == 16
    assert stats["ssd"]["entries"] > 0 and stats["hot"]["entries"] == 0  # a new process
    files = stats["ssd"]["entries"]

    code, out, _ = run(capsys, ["cache", "stats", *tiny])
    assert code == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows["ssd.entries"] == [str(files)] and "memory.peak" in rows

    code, out, _ = run(capsys, ["cache", "clear", "ssd", *tiny])
    assert code == 0 and out.startswith(f"Cleared ssd: SSD −{files} (")
    assert "\n  by this process (model tiny:llama)" in out
    code, out, _ = run(capsys, ["cache", "stats", "--json", *tiny])
    assert json.loads(out)["ssd"]["entries"] == 0


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _no_model(tmp_path, models_dir) -> list[str]:
    """The ``tiny`` flags but ``--model``: the settings' model stays the default."""
    dirs = {"--cache-dir": tmp_path / "kv", "--data-dir": tmp_path / "data"}
    dirs["--models-dir"] = models_dir
    return ["--block-size", "16", *(str(x) for kv in dirs.items() for x in kv)]


def test_cache_stats_without_model_opens_the_dirs_own_model(capsys, tmp_path, models_dir):
    engine = make_engine("tiny:llama", tmp_path, models_dir)  # cache in tmp_path / "kv"
    generate(engine, random_prompt(100, seed=4))
    engine.close()  # admission writes what the turn kept at close
    kv = tmp_path / "kv"
    files = list(kv.glob("*/*/*.safetensors"))
    folders = sorted(os.listdir(kv))
    code, out, _ = run(capsys, ["cache", "stats", "--json", *_no_model(tmp_path, models_dir)])
    assert code == 0
    stats = json.loads(out)
    assert stats["model"] == "tiny:llama"
    assert stats["ssd"]["entries"] == len(files) > 0
    # the model's own folder was opened: no folder of another model next to it
    assert sorted(os.listdir(kv)) == folders


@pytest.mark.parametrize("held", ["missing", "empty", "two models"])
def test_cache_stats_without_model_needs_one_and_creates_nothing(
    capsys, tmp_path, models_dir, held
):
    kv = tmp_path / "kv"
    if held != "missing":
        kv.mkdir()
    if held == "two models":
        for folder, model in (("a" * 16, "tiny:llama"), ("b" * 16, "tiny:qwen2")):
            (kv / folder).mkdir()
            (kv / folder / "model.json").write_text(json.dumps({"model": model}))
    before = _tree(tmp_path)
    code, out, err = run(capsys, ["cache", "stats", *_no_model(tmp_path, models_dir)])
    assert code == 2 and out == ""
    assert "--model" in err and str(kv) in err
    if held == "two models":
        assert "tiny:llama, tiny:qwen2" in err
    assert _tree(tmp_path) == before


def test_chat(capsys, tiny, monkeypatch):
    lines = [
        "hello there, a first message",
        "/regen",
        "/swipe 0 0",
        "/edit 0 a different first message",
        "/swipe 7 0",
        "/bogus",
        "/stats",
        "/new You are terse.",
        "again",
        "/quit",
        "never read",
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    code, out, err = run(capsys, ["chat", *tiny, "--max-tokens", "4"])
    assert code == 0
    metrics = [line for line in out.splitlines() if line.startswith("[cached ")]
    assert len(metrics) == 4  # hello, /regen, /edit, again
    assert metrics[0].startswith("[cached 0/")
    # regenerate: nothing new (tiny:llama's resident cache and its kept logprobs)
    assert " · prefilled 0 · " in metrics[1] and "resident " in metrics[1]
    assert "[turn 0: reply 1 of 2]" in out
    assert "unknown command /bogus" in out
    assert "[hot " in out and "[new conversation]" in out
    assert "error: no user turn 7" in err


def test_chat_continue_set_and_negative_turns(capsys, tiny, monkeypatch):
    lines = [
        "hello there, a first message",
        "/continue",
        "/swipe -1 0",
        "/set top_k 3",
        "/set top_k -1",
        "/set stop END|\\n\\n",
        "/set",
        "/regen 0",
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    code, out, err = run(capsys, ["chat", *tiny, "--max-tokens", "4"])
    assert code == 0, err
    metrics = [line for line in out.splitlines() if line.startswith("[cached ")]
    assert len(metrics) == 3  # hello, /continue, /regen 0
    # continue: the cut reply's prompt + ids are all resident, nothing is prefilled
    assert " · prefilled 0 · " in metrics[1] and "resident " in metrics[1], metrics[1]
    assert "[turn -1: reply 1 of 1]" in out  # a continue grows the reply in place
    assert "[top_k = 3]" in out and "error: top_k must be in 0 (off) .. 1048576, not -1" in err
    assert "[stop = END|\\n\\n]" in out and "[swipe_temperature = 0.8]" in out


def test_chat_ends_at_eof(capsys, tiny, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi"))  # no newline, then EOF
    code, out, _ = run(capsys, ["chat", *tiny, "--max-tokens", "2"])
    assert code == 0 and out.count("[cached ") == 1


def test_tui_gets_an_unloaded_engine_and_closes_it(capsys, tiny, monkeypatch):
    import tierchat.tui.app as app

    seen = {}

    def fake_run_app(engine, store, settings, **kwargs):  # mcp_host=None: no servers
        seen.update(engine=engine, model=engine.model_name, store=store, settings=settings)

    monkeypatch.setattr(app, "run_app", fake_run_app)
    code, _, _ = run(capsys, tiny)
    assert code == 0
    assert seen["model"] == "" and seen["settings"].model == "tiny:llama"
    assert not seen["engine"]._thread.is_alive()  # closed after the app returned
    assert Path(seen["store"].path).name == "conversations.sqlite"


def test_bench_tiny(capsys, tiny, tmp_path):
    out_json = tmp_path / "bench.json"
    argv = ["bench", *tiny, "--lengths", "48,80", "--extend", "8", "--json-out", str(out_json)]
    code, out, err = run(capsys, argv)
    assert code == 0, err
    doc = json.loads(out_json.read_text())
    rows = {(r["system"], r["case"], r["length"]): r for r in doc["rows"]}
    for n in (48, 80):
        cold = rows[("tierchat", "cold", n)]
        assert cold["cached_tokens"] == 0 and cold["prefill_tokens"] == n
        assert rows[("tierchat", "exact hot", n)]["prefill_tokens"] == 0  # kept logprobs
        assert rows[("tierchat", "exact ssd", n)]["prefill_tokens"] == 1
        near = rows[("tierchat", "nearest hot", n)]
        assert near["prompt_tokens"] == n + 8 and near["cached_tokens"] >= n - 1
        assert rows[("mlx-lm LRU", "cold", n)]["cached_tokens"] == 0
        assert rows[("mlx-lm LRU", "exact hot", n)]["prefill_tokens"] == 1
        assert rows[("mlx-lm LRU", "nearest hot", n)]["cached_tokens"] == n
        # exact hot cuts the resident cache back in place: nothing is copied
        hot = rows[("tierchat", "exact hot", n)]
        assert hot["restore_s"] > 0 and hot["restore_bytes"] == 0 and hot["speedup"] > 0
        for r in (rows[("tierchat", "exact ssd", n)],):
            assert r["restore_s"] > 0 and r["restore_bytes"] > 0 and r["speedup"] > 0
    assert "page cache" in doc["page_cache"]
    assert "exact ssd" in out and "mlx-lm LRU" in out
    # the bench used a throwaway SSD dir: the configured one stays empty
    assert not any((tmp_path / "kv").rglob("*.safetensors"))


def test_bench_bad_lengths(capsys, tiny):
    code, _, err = run(capsys, ["bench", *tiny, "--lengths", "512,x"])
    assert code == 2 and err.startswith("error: --lengths")


def test_serve_limit_flags_fill_serve_limits(capsys):
    """Each ``serve`` limit flag reaches its :class:`ServeLimits` field, and ``--help``
    names every one with its default."""
    from tierchat.cli.main import build_parser
    from tierchat.core.serve.limits import ServeLimits, limits_from_args

    parser = build_parser()
    assert limits_from_args(parser.parse_args(["serve"])) == ServeLimits()
    argv = ["serve", "--max-body-bytes", "9", "--max-messages", "3", "--max-connections", "2"]
    argv += ["--allowed-host", "a", "--allowed-host", "b", "--allowed-origin", "*"]
    assert limits_from_args(parser.parse_args(argv)) == ServeLimits(
        max_body_bytes=9,
        max_messages=3,
        max_connections=2,
        allowed_hosts=("a", "b"),
        allowed_origins=("*",),
    )
    assert main(["serve", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    d = ServeLimits()
    for text in (
        f"--max-body-bytes N refuse larger request bodies with 413 (default {d.max_body_bytes})",
        f"--max-messages N refuse chats of more messages (default {d.max_messages})",
        f"--max-connections N open connections at most (default {d.max_connections}; past it:",
    ):
        assert text in out
