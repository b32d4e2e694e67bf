"""``tierchat replay`` (docs/DESIGN.md §14): output format, cache accounting, errors.

Runs ``main(argv)`` in-process on tiny models (block size 16) with a tmp cache, data and
config; every engine the command starts is closed by the command itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from tierchat.cli.main import main
from tierchat.cli.replay import RESULT_FIELDS, ScriptError, parse_script, token_ids_sha256
from tierchat.core.models.tiny import TINY_ARCHS

SOURCES = {"hot", "ssd"}
KINDS = {"resident", "block", "tail", "checkpoint"}

FULL_SCRIPT = [
    {"op": "new", "system": "You are a terse assistant."},
    {"op": "user", "text": "Tell me about prefix caches in a few words please.", "max_tokens": 6},
    {"op": "regenerate", "max_tokens": 6},
    {"op": "user", "text": "And what about the SSD tier?", "max_tokens": 6},
    {"op": "edit", "turn": 1, "text": "And the hot tier?", "max_tokens": 6},
    {"op": "swipe", "turn": 0, "index": 0},
    {"op": "restart"},
    {"op": "user", "text": "Once more after a restart.", "max_tokens": 6},
    {"op": "clear", "tier": "hot"},
    {"op": "regenerate", "max_tokens": 6},
    {"op": "clear", "tier": "all"},
    {"op": "regenerate", "max_tokens": 4},
]


pytestmark = pytest.mark.usefixtures("isolated_settings")


def write_script(path: Path, ops: list, blank_after: int | None = None) -> Path:
    lines = [json.dumps(op) for op in ops]
    if blank_after is not None:
        lines.insert(blank_after + 1, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def flags(tmp_path: Path, models_dir: Path, model: str = "tiny:llama", tag: str = "") -> list[str]:
    return [
        "--model",
        model,
        "--block-size",
        "16",
        "--cache-dir",
        str(tmp_path / f"kv{tag}"),
        "--models-dir",
        str(models_dir),
    ]


def replay(capsys, argv: list[str]) -> tuple[int, list[dict], str]:
    code = main(["replay", *argv])
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert "Traceback" not in err
    return code, lines, err


def check_line(line: dict) -> None:
    assert tuple(line) == RESULT_FIELDS  # exactly these fields, in this order
    assert set(line["cached_by"]) == SOURCES
    assert line["cached_tokens"] + line["prefill_tokens"] == line["prompt_tokens"]
    assert sum(line["cached_by"].values()) == line["cached_tokens"]
    assert set(line["cached_kind"]) == KINDS
    assert sum(line["cached_kind"].values()) == line["cached_tokens"]
    # the model is fed >= 1 token, unless the whole prompt was restored with the logprobs
    # of its first token kept: in the resident cache, or with the prompt's tail
    kind = line["cached_kind"]
    whole = line["cached_tokens"] == line["prompt_tokens"]
    kept = kind["resident"] == line["prompt_tokens"] or (whole and kind["tail"] > 0)
    assert line["prefill_tokens"] >= 1 or kept
    assert line["generation_tokens"] >= 1
    assert line["ttft_s"] > 0 and line["peak_memory_bytes"] > 0
    assert isinstance(line["text"], str)
    assert len(line["token_ids_sha256"]) == 64


def test_full_script(tmp_path, models_dir, capsys):
    script = write_script(tmp_path / "s.jsonl", FULL_SCRIPT, blank_after=5)
    code, lines, err = replay(capsys, [str(script), *flags(tmp_path, models_dir)])
    assert code == 0, err
    *results, summary = lines
    for line in results:
        check_line(line)
    # op_index is the 0-based line number (a blank line after line 5 shifts the rest)
    assert [(r["op_index"], r["op"]) for r in results] == [
        (1, "user"),
        (2, "regenerate"),
        (3, "user"),
        (4, "edit"),
        (8, "user"),
        (10, "regenerate"),
        (12, "regenerate"),
    ]
    by_index = {r["op_index"]: r for r in results}
    first, regen = by_index[1], by_index[2]
    assert first["cached_tokens"] == 0
    assert regen["prompt_tokens"] == first["prompt_tokens"] and regen["prefill_tokens"] == 0
    assert regen["token_ids_sha256"] == first["token_ids_sha256"]  # greedy: same reply
    # the edit shares the system + first exchange with the previous prompt
    assert by_index[4]["cached_tokens"] >= 16
    # after the restart nothing is hot: the prefix comes from the SSD tier
    after = by_index[8]
    assert after["cached_by"]["ssd"] > 0 and after["cached_by"]["hot"] == 0
    # hot cleared: regenerate still restores all N (SSD blocks + the persisted tail, which
    # kept the first token's logprobs on the folded schedule, the default)
    assert by_index[10]["prefill_tokens"] == 0 and by_index[10]["cached_kind"]["tail"] > 0
    # everything cleared: cold again
    assert by_index[12]["cached_tokens"] == 0

    s = summary["summary"]
    assert s["generations"] == len(results) and s["errors"] == 0 and s["restarts"] == 1
    for key in ("prompt_tokens", "cached_tokens", "prefill_tokens", "generation_tokens"):
        assert s[key] == sum(r[key] for r in results)
    assert s["cached_tokens"] + s["prefill_tokens"] == s["prompt_tokens"]
    assert s["cached_by"] == {k: sum(r["cached_by"][k] for r in results) for k in SOURCES}
    assert s["cached_kind"] == {k: sum(r["cached_kind"][k] for r in results) for k in KINDS}
    ttfts = sorted(r["ttft_s"] for r in results)
    assert s["ttft_s_median"] == pytest.approx(ttfts[len(ttfts) // 2], abs=1e-6)
    assert s["ttft_s_mean"] == pytest.approx(sum(ttfts) / len(ttfts), abs=1e-6)
    assert s["cache"]["model"] == "tiny:llama" and "hot" in s["cache"] and "ssd" in s["cache"]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_tiny_arch(arch, tmp_path, models_dir, capsys):
    ops = [
        {"op": "new", "system": "sys"},
        {"op": "user", "text": "A first message long enough to fill two blocks.", "max_tokens": 3},
        {"op": "regenerate", "max_tokens": 3},
        {"op": "user", "text": "Second.", "max_tokens": 3},
    ]
    script = write_script(tmp_path / "s.jsonl", ops)
    code, lines, err = replay(capsys, [str(script), *flags(tmp_path, models_dir, f"tiny:{arch}")])
    assert code == 0, err
    *results, summary = lines
    assert [r["op"] for r in results] == ["user", "regenerate", "user"]
    for line in results:
        check_line(line)
    assert results[1]["token_ids_sha256"] == results[0]["token_ids_sha256"]
    if summary["summary"]["cache"]["supported"]:
        # no token where the resident cache can be cut back to the whole prompt (always
        # on KV-only models), else one
        kinds = {k.split(":")[1] for k in summary["summary"]["cache"]["layer_kinds"]}
        assert results[1]["prefill_tokens"] in ({0} if kinds == {"kv"} else {0, 1})
        assert results[2]["cached_tokens"] > 0
    else:
        assert "warning:" in err  # caching off for this model, said once


def test_no_cache_matches_cached_run(tmp_path, models_dir, capsys):
    ops = [o for o in FULL_SCRIPT if o["op"] not in ("clear",)]
    script = write_script(tmp_path / "s.jsonl", ops)
    code, cached, err = replay(capsys, [str(script), *flags(tmp_path, models_dir, tag="a")])
    assert code == 0, err
    code, cold, err = replay(
        capsys, [str(script), *flags(tmp_path, models_dir, tag="b"), "--no-cache"]
    )
    assert code == 0, err
    cached, cold = cached[:-1], cold[:-1]
    assert sum(r["cached_tokens"] for r in cached) > 0
    assert all(r["cached_tokens"] == 0 for r in cold)
    for r in cold:
        check_line(r)
    assert [r["token_ids_sha256"] for r in cold] == [r["token_ids_sha256"] for r in cached]
    assert [r["text"] for r in cold] == [r["text"] for r in cached]


def test_failed_ops_print_error_lines_and_the_script_goes_on(tmp_path, models_dir, capsys):
    ops = [
        {"op": "regenerate", "max_tokens": 2},  # nothing to regenerate yet
        {"op": "user", "text": "hello", "max_tokens": 2},
        {"op": "swipe", "turn": 3, "index": 0},  # no such turn
        {"op": "edit", "turn": 0, "text": "hi", "max_tokens": 2},
    ]
    script = write_script(tmp_path / "s.jsonl", ops)
    code, lines, err = replay(capsys, [str(script), *flags(tmp_path, models_dir)])
    assert code == 1
    assert lines[0] == {"op_index": 0, "op": "regenerate", "error": lines[0]["error"]}
    assert "nothing to regenerate" in lines[0]["error"]
    assert lines[1]["op"] == "user" and "error" not in lines[1]
    assert set(lines[2]) == {"op_index", "op", "error"} and lines[2]["op_index"] == 2
    assert lines[3]["op"] == "edit" and "error" not in lines[3]
    assert lines[4]["summary"]["errors"] == 2 and lines[4]["summary"]["generations"] == 2
    assert f"error: {script}:1: regenerate:" in err and f"error: {script}:3: swipe:" in err


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"text": "hi"}', 'missing "op"'),
        ('{"op": "dance"}', "unknown op 'dance'"),
        ('{"op": "user"}', 'needs "text"'),
        ('{"op": "user", "text": 5}', '"text" must be a string'),
        ('{"op": "user", "text": "x", "max_tokens": 0}', '"max_tokens" must be a positive'),
        ('{"op": "user", "text": "x", "max_token": 5}', 'unknown field "max_token"'),
        ('{"op": "edit", "text": "x"}', 'needs "turn"'),
        ('{"op": "swipe", "turn": -1, "index": 0}', '"turn" must be a non-negative'),
        ('{"op": "swipe", "turn": 0, "index": true}', '"index" must be an integer'),
        ('{"op": "clear", "tier": "l2"}', '"tier" must be one of hot, ssd, tails, all'),
        ('{"op": "user", "text": "x", "temperature": -1}', '"temperature" must be'),
    ],
)
def test_malformed_line_names_the_line(bad, expected, tmp_path, models_dir, capsys):
    script = tmp_path / "bad.jsonl"
    script.write_text('{"op": "new"}\n\n' + bad + '\n{"op": "user", "text": "never runs"}\n')
    code, lines, err = replay(capsys, [str(script), *flags(tmp_path, models_dir)])
    assert code == 2 and lines == []  # checked before anything runs
    assert err.startswith(f"error: {script}:3: ") and expected in err
    assert err.count("\n") == 1


def test_missing_script(tmp_path, models_dir, capsys):
    code, lines, err = replay(capsys, [str(tmp_path / "nope.jsonl"), *flags(tmp_path, models_dir)])
    assert code == 2 and lines == []
    assert err == f"error: {tmp_path / 'nope.jsonl'}: no such file\n"


def test_script_from_stdin(tmp_path, models_dir, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO('{"op": "user", "text": "hi", "max_tokens": 2}\n'))
    code, lines, err = replay(capsys, ["-", *flags(tmp_path, models_dir)])
    assert code == 0, err
    check_line(lines[0])


def test_store_is_throwaway_unless_data_dir_given(tmp_path, models_dir, capsys, monkeypatch):
    script = write_script(tmp_path / "s.jsonl", [{"op": "user", "text": "hi", "max_tokens": 2}])
    env_dir = tmp_path / "env-data"
    monkeypatch.setenv("TIERCHAT_DATA_DIR", str(env_dir))
    code, _, _ = replay(capsys, [str(script), *flags(tmp_path, models_dir)])
    assert code == 0 and not (env_dir / "conversations.sqlite").exists()
    given = tmp_path / "given-data"
    code, _, _ = replay(
        capsys, [str(script), *flags(tmp_path, models_dir), "--data-dir", str(given)]
    )
    assert code == 0 and (given / "conversations.sqlite").exists()


def test_parse_script_reports_one_based_lines():
    ops = parse_script(['{"op": "new"}', "", '{"op": "restart"}'], "x.jsonl")
    assert [(o.index, o.op) for o in ops] == [(0, "new"), (2, "restart")]
    with pytest.raises(ScriptError, match=r"^x.jsonl:2: unknown op"):
        parse_script(['{"op": "new"}', '{"op": "nope"}'], "x.jsonl")


def test_token_ids_sha256_definition():
    assert token_ids_sha256([12, 7, 99]) == hashlib.sha256(b"12,7,99").hexdigest()
    assert token_ids_sha256([]) == hashlib.sha256(b"").hexdigest()


@pytest.mark.slow
def test_demo_replay(tmp_path, models_dir, capsys):
    ops = [
        {"op": "new", "system": "You are a helpful assistant. Answer in one short sentence."},
        {"op": "user", "text": "What is a prefix cache?", "max_tokens": 12},
        {"op": "regenerate", "max_tokens": 12},
        {"op": "user", "text": "Why does it help time to first token?", "max_tokens": 12},
        {"op": "edit", "turn": 1, "text": "Name one downside.", "max_tokens": 12},
        {"op": "swipe", "turn": 0, "index": 0},
        {"op": "restart"},
        {"op": "user", "text": "Thanks.", "max_tokens": 8},
    ]
    script = write_script(tmp_path / "s.jsonl", ops)
    argv = [str(script), "--model", "demo", "--block-size", "32"]
    argv += ["--cache-dir", str(tmp_path / "kv"), "--models-dir", str(models_dir)]
    code, lines, err = replay(capsys, argv)
    assert code == 0, err
    *results, _summary = lines
    assert [r["op"] for r in results] == ["user", "regenerate", "user", "edit", "user"]
    for line in results:
        check_line(line)
    assert results[1]["prefill_tokens"] == 0  # the resident cache and its kept logprobs
    assert results[1]["token_ids_sha256"] == results[0]["token_ids_sha256"]
    assert results[2]["cached_tokens"] > 0 and results[3]["cached_tokens"] > 0
    assert results[4]["cached_by"]["ssd"] > 0


def test_refused_prefill_is_an_error_line(tmp_path, models_dir, capsys):
    ops = [
        {"op": "user", "text": "x" * 3000, "max_tokens": 2},  # over a 1 MB limit
        {"op": "new"},
    ]
    script = write_script(tmp_path / "s.jsonl", ops)
    argv = [str(script), *flags(tmp_path, models_dir), "--memory-limit", "1MB"]
    code, lines, err = replay(capsys, argv)
    assert code == 1
    assert set(lines[0]) == {"op_index", "op", "error"}
    assert lines[0]["error"].startswith("refused: ") and "memory limit" in lines[0]["error"]
    assert lines[-1]["summary"]["errors"] == 1 and lines[-1]["summary"]["ops"] == 2
    assert f"error: {script}:1: user: refused: " in err


def test_refusal_leaves_store_and_ssd_intact(tmp_path, models_dir, capsys):
    """A refused prefill in one run; the store and SSD tier serve the next run."""
    data = ["--data-dir", str(tmp_path / "data")]
    warm = [{"op": "new", "system": "Be brief."}, {"op": "user", "text": "tides " * 20}]
    script = write_script(tmp_path / "warm.jsonl", warm)
    code, lines, _ = replay(capsys, [str(script), *flags(tmp_path, models_dir), *data])
    assert code == 0
    files = sorted((tmp_path / "kv").rglob("*.safetensors"))
    store = (tmp_path / "data" / "conversations.sqlite").read_bytes()
    assert files

    refused = [{"op": "new"}, {"op": "user", "text": "x" * 3000, "max_tokens": 2}]
    script = write_script(tmp_path / "big.jsonl", refused)
    argv = [str(script), *flags(tmp_path, models_dir), *data, "--memory-limit", "1MB"]
    code, lines, _ = replay(capsys, argv)
    assert code == 1 and lines[0]["error"].startswith("refused: ")
    assert sorted((tmp_path / "kv").rglob("*.safetensors")) == files  # nothing lost

    code, lines, _ = replay(
        capsys, [str(tmp_path / "warm.jsonl"), *flags(tmp_path, models_dir), *data]
    )
    assert code == 0 and lines[0]["cached_by"]["ssd"] > 0
    assert len((tmp_path / "data" / "conversations.sqlite").read_bytes()) >= len(store)


def test_a_new_that_fails_on_a_locked_store_skips_its_conversations_ops(
    tmp_path, models_dir, capsys, monkeypatch
):
    """Another process holds the store's write lock while the second ``new`` runs: that
    ``new`` fails, its conversation's ops are skipped and reported (never run in the first
    conversation, without the script's system prompt), and the third conversation runs."""
    import sqlite3
    import tomllib

    from tierchat.core.chat.store import ConversationStore

    config = Path(os.environ["TIERCHAT_CONFIG"])
    config.write_text("store_busy_s = 0.2\n")
    assert tomllib.loads(config.read_text())["store_busy_s"] == 0.2
    real = ConversationStore.create_conversation
    calls = []

    def create_while_locked(self, title=None, system=None):
        calls.append(system)
        if len(calls) != 2:
            return real(self, title, system)
        other = sqlite3.connect(self.path, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")  # another process writing the store
        try:
            return real(self, title, system)
        finally:
            other.execute("ROLLBACK")
            other.close()

    monkeypatch.setattr(ConversationStore, "create_conversation", create_while_locked)
    ops = [
        {"op": "new", "system": "First."},
        {"op": "user", "text": "one", "max_tokens": 2},
        {"op": "new", "system": "Second, whose system prompt matters."},
        {"op": "user", "text": "two", "max_tokens": 2},
        {"op": "regenerate", "max_tokens": 2},
        {"op": "clear", "tier": "hot"},
        {"op": "new", "system": "Third."},
        {"op": "user", "text": "three", "max_tokens": 2},
    ]
    script = write_script(tmp_path / "s.jsonl", ops)
    code, lines, err = replay(capsys, [str(script), *flags(tmp_path, models_dir)])
    assert code == 1
    by_index = {line["op_index"]: line for line in lines if "op_index" in line}
    assert "not saved" in by_index[2]["error"]
    for i in (3, 4):
        assert by_index[i]["error"].startswith("skipped: the new conversation of line 3")
        assert f"s.jsonl:{i + 1}: " in err
    assert "error" not in by_index[1] and "error" not in by_index[7]
    assert lines[-1]["summary"]["generations"] == 2 and lines[-1]["summary"]["errors"] == 3
