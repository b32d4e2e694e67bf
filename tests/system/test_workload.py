"""``tierchat bench --workload`` (cli/bench/workload.py): the shipped workloads, op kinds, the
per-kind summary, and the CI-sized workload on tiny:qwen2 and demo against cold runs.

Tokens are asserted, never wall-clock (docs/DESIGN.md §17)."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter

import pytest
from tierchat.cli.bench import workload
from tierchat.cli.common import CLIError
from tierchat.cli.main import main
from tierchat.cli.replay import parse_script
from tierchat.config.settings import Settings
from tierchat.core.api import Finished, GenerateRequest
from tierchat.core.engine.engine import Engine
from tierchat.core.models import shapes
from tierchat.core.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("isolated_settings")
SYSTEMS = (workload.TIERCHAT, workload.MLX_LM)


def ops_of(*lines: dict):
    return parse_script([json.dumps(x) for x in lines], "t.jsonl")


# --------------------------------------------------------------------------- the scripts


def test_shipped_workloads_have_the_issue_op_mix():
    for name, conversations, max_tokens in (("chat", 8, 40), ("chat-ci", 2, 8)):
        path, ops = workload.read_workload(name)
        assert path.endswith(workload.NAMED[name])
        kinds = Counter(workload.op_kinds(ops).values())
        assert kinds == {k: conversations for k in workload.KINDS}, name
        assert [op.op for op in ops[:8]] == [
            "new", "user", "user", "regenerate", "edit", "user", "restart", "user"
        ]  # fmt: skip
        systems = {op.args["system"] for op in ops if op.op == "new"}
        assert len(systems) == 1 and "Lib/json/encoder.py" in systems.pop()
        assert {op.args.get("max_tokens") for op in ops if op.op in workload.GENERATING} == {
            max_tokens
        }
        texts = [op.args["text"] for op in ops if "text" in op.args]
        assert len(set(texts)) == len(texts)  # every question its own


@pytest.mark.skipif(
    importlib.util.find_spec(shapes.DEMO_GGUF_HEADER_PACKAGE) is None,
    reason="the Qwen2.5 tokenizer comes from the demo package",
)
def test_chat_system_prompt_is_35_to_4k_qwen_tokens(models_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(shapes.tokenizer_dir(models_dir) / "tokenizer.json"))
    sizes = {}
    for name in ("chat", "chat-ci"):
        _, ops = workload.read_workload(name)
        sizes[name] = len(tok.encode(ops[0].args["system"]).ids)
    assert 3400 <= sizes["chat"] <= 4000 and sizes["chat-ci"] < 500


def test_a_sampled_op_is_refused(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"op": "new"}\n{"op": "user", "text": "hi"}\n{"op": "regenerate", "temperature": 0.7}\n'
    )
    with pytest.raises(CLIError, match=r"w.jsonl:3: the workload bench is greedy"):
        workload.read_workload(str(path))
    path.write_text('{"op": "new"}\n{"op": "restart"}\n')
    with pytest.raises(CLIError, match="no generating op"):
        workload.read_workload(str(path))


def test_gzipped_scripts_are_checked_like_plain_ones(tmp_path):
    import gzip

    path = tmp_path / "w.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"op": "new"}\n{"op": "user", "text": "hi"}\n'))
    assert [op.op for op in workload.read_workload(str(path))[1]] == ["new", "user"]
    path.write_bytes(gzip.compress(b'{"op": "new"}\n{"op": "usr"}\n'))
    with pytest.raises(CLIError, match=r"w.jsonl.gz:2: unknown op 'usr'"):
        workload.read_workload(str(path))
    path.write_bytes(b"not gzip")
    with pytest.raises(CLIError, match="not a gzipped UTF-8 script"):
        workload.read_workload(str(path))
    with pytest.raises(CLIError, match="no such file"):
        workload.read_workload(str(tmp_path / "none.jsonl.gz"))


def test_op_kinds():
    ops = ops_of(
        {"op": "user", "text": "a"},  # no "new": the session opens a conversation
        {"op": "user", "text": "b"},
        {"op": "edit", "turn": 1, "text": "b2"},
        {"op": "regenerate"},  # after an edit, but not a user turn
        {"op": "user", "text": "c"},
        {"op": "new", "system": "s"},
        {"op": "user", "text": "d"},
        {"op": "edit", "turn": 0, "text": "d2"},
        {"op": "swipe", "turn": 0, "index": 0},
        {"op": "user", "text": "e"},
        {"op": "restart"},
        {"op": "regenerate"},
        {"op": "user", "text": "f"},
    )
    kinds = workload.op_kinds(ops)
    assert [kinds[op.index] for op in ops if op.index in kinds] == [
        "new conversation", "next user turn", "edit", "regenerate", "next user turn",
        "new conversation", "edit", "turn after the edit", "turn after a restart",
        "next user turn",
    ]  # fmt: skip


def test_summary_counts_tokens_and_nearest_rank_p90():
    def r(kind, tc, mlx):
        return {
            "kind": kind,
            workload.TIERCHAT: {"prefill_tokens": tc[0], "ttft_s": tc[1]},
            workload.MLX_LM: {"prefill_tokens": mlx[0], "ttft_s": mlx[1]},
        }

    rows = [r("edit", (10, 0.1), (20, 0.2)), r("edit", (30, 0.3), (40, 0.4))]
    rows += [r("regenerate", (0, 0.01), (1, 0.04))]
    summary = {e["kind"]: e for e in workload.summarize(rows)}
    assert list(summary) == ["regenerate", "edit", "all"]
    edit = summary["edit"]
    assert edit["count"] == 2 and edit[workload.TIERCHAT]["prefill_tokens"] == 40
    assert edit[workload.MLX_LM]["ttft_median_s"] == pytest.approx(0.3)
    assert edit[workload.MLX_LM]["ttft_worst_s"] == 0.4
    assert edit["ratio"] == pytest.approx(0.2 / 0.3)
    assert summary["all"][workload.TIERCHAT]["prefill_tokens"] == 40
    assert summary["regenerate"]["ratio"] == pytest.approx(0.25)
    assert workload.p90([5, 1, 2, 3, 4, 6, 7, 8, 9, 10]) == 9
    assert workload.p90([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]) == 10
    assert workload.p90([0.5]) == 0.5
    text = workload.format_summary(workload.summarize(rows))
    assert "vs mlx-lm" in text and "0.67x" in text


# --------------------------------------------------------------------------- real runs


def settings_for(tmp_path, models_dir, model: str, block_size: int) -> Settings:
    return Settings(
        model=model,
        block_size=block_size,
        cache_dir=tmp_path / "kv",
        models_dir=models_dir,
        data_dir=tmp_path / "data",
        hot_bytes=512 << 20,
        ssd_bytes=1 << 30,
    )


def cold_tokens(settings: Settings, result: workload.WorkloadResult) -> list[tuple[int, ...]]:
    """Each request's prompt generated again on a fresh engine with the cache off."""
    engine = Engine(settings)
    try:
        loaded = engine.load_model(settings.model).wait(300)
        assert not hasattr(loaded, "message"), loaded
        out = []
        for row, prompt in zip(result.rows, result.prompts, strict=True):
            request = GenerateRequest(
                sampling=SamplingParams(max_tokens=row["max_tokens"]),
                prompt_ids=prompt,
                use_cache=False,
            )
            got = engine.submit(request).wait(300)
            assert isinstance(got, Finished), got
            out.append(got.token_ids)
        return out
    finally:
        engine.close()


def check_run(settings: Settings, result: workload.WorkloadResult) -> dict:
    """What must hold on any model: every request on both systems, the prompt each saw,
    both equal to a cold run, the restart's effects; returns the per-kind summary."""
    rows = result.rows
    assert len(rows) == 12 and len(result.prompts) == 12
    assert [r["first"] for r in rows] == [workload.TIERCHAT, workload.MLX_LM] * 6
    for row, prompt, cold in zip(rows, result.prompts, cold_tokens(settings, result), strict=True):
        assert row["prompt_tokens"] == len(prompt)
        for system in SYSTEMS:
            r = row[system]
            assert r["cached_tokens"] + r["prefill_tokens"] == row["prompt_tokens"]
            assert tuple(r["token_ids"]) == cold, (row["line"], system)
        assert row["same_tokens"] is True
    first = rows[0]
    assert first["kind"] == "new conversation"
    assert all(first[s]["cached_tokens"] == 0 for s in SYSTEMS)
    for row in rows:
        if row["kind"] == "turn after a restart":
            assert row[workload.MLX_LM]["cached_tokens"] == 0  # its LRU was emptied
            assert row[workload.TIERCHAT]["cached_by"]["ssd"] > 0
        if row["kind"] == "regenerate":
            assert row[workload.TIERCHAT]["prefill_tokens"] == 0
    summary = {e["kind"]: e for e in workload.summarize(rows)}
    assert set(summary) == {*workload.KINDS, "all"}
    for entry in summary.values():
        for system in SYSTEMS:
            assert entry[system]["prefill_tokens"] >= 0
            assert entry[system]["ttft_median_s"] <= entry[system]["ttft_worst_s"]
    return summary


def test_ci_workload_on_tiny_qwen2(tmp_path, models_dir):
    settings = settings_for(tmp_path, models_dir, "tiny:qwen2", 16)
    _, ops = workload.read_workload("chat-ci")
    result = workload.run_workload(settings, ops, "chat-ci")
    summary = check_run(settings, result)
    tc = summary["all"][workload.TIERCHAT]["prefill_tokens"]
    mlx = summary["all"][workload.MLX_LM]["prefill_tokens"]
    assert tc <= 0.5 * mlx, (tc, mlx)


def test_bench_workload_command_writes_every_row(tmp_path, models_dir, capsys):
    out_json = tmp_path / "w.json"
    argv = ["bench", "--workload", "chat-ci", "--model", "tiny:qwen2", "--block-size", "16"]
    argv += ["--warmup", "unrelated", "--json", str(out_json)]
    argv += ["--cache-dir", str(tmp_path / "kv"), "--data-dir", str(tmp_path / "data")]
    argv += ["--models-dir", str(models_dir)]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out_json.read_text())
    assert doc["device"] == out.splitlines()[0].rsplit(" · ", 1)[1]
    assert doc["warmup"] == "unrelated" and doc["warmup_lengths"] == [96, 480, 1500]
    _, ops = workload.read_workload("chat-ci")
    generating = [op.index + 1 for op in ops if op.op in workload.GENERATING]
    assert [r["line"] for r in doc["rows"]] == generating
    assert [r["request"] for r in doc["rows"]] == list(range(12))
    # the warm-up shares no prefix with the workload and leaves mlx-lm's LRU empty
    assert all(doc["rows"][0][s]["cached_tokens"] == 0 for s in SYSTEMS)
    kinds = [e["kind"] for e in doc["summary"]]
    assert kinds == [*workload.KINDS, "all"]
    for kind in kinds:  # every kind is a table row with both systems' prefilled tokens
        line = next(x for x in out.splitlines() if x.startswith(kind + " "))
        entry = next(e for e in doc["summary"] if e["kind"] == kind)
        numbers = line[len(kind) :].split()
        assert numbers[1] == str(entry[workload.TIERCHAT]["prefill_tokens"])
        assert numbers[5] == str(entry[workload.MLX_LM]["prefill_tokens"])
    assert "same reply tokens in 12 of 12 requests" in out
    assert "12/12 turn after a restart" in err


def test_bench_workload_without_baseline(tmp_path, models_dir, capsys):
    argv = ["bench", "--workload", "chat-ci", "--model", "tiny:llama", "--no-baseline"]
    argv += ["--block-size", "16", "--cache-dir", str(tmp_path / "kv")]
    argv += ["--data-dir", str(tmp_path / "data"), "--models-dir", str(models_dir)]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    all_line = next(x for x in out.splitlines() if x.startswith("all "))
    assert all_line.split()[-1] == "-"  # no ratio without mlx-lm


def test_missing_workload_is_a_usage_error(tmp_path, capsys):
    argv = ["bench", "--workload", str(tmp_path / "nope.jsonl"), "--model", "tiny:llama"]
    argv += ["--cache-dir", str(tmp_path / "kv"), "--data-dir", str(tmp_path / "data")]
    assert main(argv) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err


@pytest.mark.slow
def test_ci_workload_on_demo(tmp_path, models_dir):
    settings = settings_for(tmp_path, models_dir, "demo", 32)
    _, ops = workload.read_workload("chat-ci")
    result = workload.run_workload(settings, ops, "chat-ci")
    summary = check_run(settings, result)
    tc = summary["all"][workload.TIERCHAT]["prefill_tokens"]
    mlx = summary["all"][workload.MLX_LM]["prefill_tokens"]
    assert tc < mlx
