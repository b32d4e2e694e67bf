"""``tierchat bench`` plumbing (cli/bench/main.py): prompts, the disk read measurement, the
ratio columns, and a run on a (shrunk) ``shape:`` model with JSON out."""

from __future__ import annotations

import importlib.util
import json

import pytest
from tierchat.cli.bench import main as bench
from tierchat.cli.main import main
from tierchat.core.models import shapes

pytestmark = pytest.mark.usefixtures("isolated_settings")


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize("n", [2, 100, 5000])
def test_make_prompt_is_exact_deterministic_and_salted(n):
    tok = CharTokenizer()
    a = bench.make_prompt(tok, n, salt=0)
    assert len(a) == n and a == bench.make_prompt(tok, n, salt=0)
    assert a[0] != bench.make_prompt(tok, n, salt=1)[0]


def test_measured_prompts_never_share_a_first_word_with_each_other_or_the_warm_up():
    tok = CharTokenizer()
    lengths = [50, 60, 70]
    r = bench.max_repeat(len(lengths))
    assert r >= 3
    prompts = bench.measured_prompts(tok, lengths, r)
    firsts = [bytes(p[:3]) for n in lengths for p in prompts[n]]
    assert [len(p) for n in lengths for p in prompts[n]] == [n for n in lengths for _ in range(r)]
    warm = [bench.make_prompt(tok, 50, salt=bench.WARMUP_SALT - k)[:3] for k in range(4)]
    assert len(set(firsts)) == len(firsts) and not set(firsts) & {bytes(w) for w in warm}


def test_median_row_shows_the_middle_run_and_keeps_every_run():
    def got(ttft, cached, restore_s):
        counts = {"prompt_tokens": 64, "cached_tokens": cached, "prefill_tokens": 64 - cached}
        return {**counts, "ttft_s": ttft}, (restore_s, 1000)

    runs = [got(0.3, 63, 0.03), got(0.1, 63, 0.01), got(0.2, 62, 0.02)]
    row = bench._median_row("tierchat", "exact hot", 64, runs)
    assert (row["ttft_s"], row["cached_tokens"], row["restore_s"]) == (0.2, 62, 0.02)
    assert row["ttft_runs_s"] == [0.3, 0.1, 0.2] and row["cached_runs"] == [63, 63, 62]
    even = bench._median_row("tierchat", "cold", 64, runs[:2])
    assert even["ttft_s"] == 0.1  # the lower middle one


def test_hot_rows_take_turns_request_by_request():
    calls = []

    def runner(system):
        def run(prompt):
            calls.append((system, prompt))
            cached = {1: 0, 2: 1}.get(sum(1 for s, q in calls if s == system and q == prompt))
            counts = {"prompt_tokens": len(prompt), "cached_tokens": cached or 0}
            return {**counts, "prefill_tokens": 1, "ttft_s": 0.01 * len(calls)}, (0.0, 0)

        return run

    prompts, ext = [[1, 2], [3, 4]], [9]
    rows = bench._hot_rows(2, prompts, ext, {"a": runner("a"), "b": runner("b")})
    assert calls == [
        ("a", [1, 2]), ("b", [1, 2]), ("a", [1, 2]), ("b", [1, 2]),
        ("a", [1, 2, 9]), ("b", [1, 2, 9]),
        ("b", [3, 4]), ("a", [3, 4]), ("b", [3, 4]), ("a", [3, 4]),
        ("b", [3, 4, 9]), ("a", [3, 4, 9]),
    ]  # fmt: skip
    assert [(r["system"], r["case"]) for r in rows] == [
        (s, c) for s in "ab" for c in ("cold", "exact hot", "nearest hot")
    ]
    exact_a = rows[1]
    assert exact_a["cached_runs"] == [1, 1] and exact_a["ttft_runs_s"] == [0.03, 0.10]


def test_repeat_out_of_range_is_a_usage_error(capsys, tmp_path):
    argv = ["bench", "--model", "tiny:llama", "--lengths", "40,50", "--repeat", "30"]
    argv += ["--cache-dir", str(tmp_path / "kv"), "--data-dir", str(tmp_path / "data")]
    assert main(argv) == 2
    assert "--repeat 30: expected 1 to 11" in capsys.readouterr().err


def test_measure_read_bandwidth_reads_every_byte(tmp_path):
    sizes = [0, 1, (1 << 20) + 3, 5 << 20]
    paths = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(bytes(size))
        paths.append(path)
    got = bench.measure_read_bandwidth(paths, buffer_bytes=1 << 20)
    assert (got.files, got.nbytes) == (4, sum(sizes))
    assert got.seconds > 0 and got.gbps == pytest.approx(got.nbytes / got.seconds / 1e9)
    assert "GB/s" in bench.disk_line(got) and "4 SSD files" in bench.disk_line(got)
    assert "not measured" in bench.disk_line(None)


def row(system, case, ttft, restore_gbps=None):
    return {"system": system, "case": case, "length": 64, "prompt_tokens": 64,
            "cached_tokens": 63, "prefill_tokens": 1, "ttft_s": ttft, "restore_s": None,
            "restore_gbps": restore_gbps}  # fmt: skip


def test_ratios_pair_each_tierchat_row_with_mlx_lms():
    rows = [
        row("tierchat", "cold", 1.0),
        row("tierchat", "exact hot", 0.01),
        row("tierchat", "exact ssd", 0.1, restore_gbps=1.5),
        row("mlx-lm LRU", "cold", 2.0),
        row("mlx-lm LRU", "exact hot", 0.04),
    ]
    disk = bench.ReadBandwidth(files=3, nbytes=3_000_000, seconds=0.001, gbps=3.0, dropped=True)
    bench.add_ratios(rows, disk)
    assert [r["vs_mlx_lm"] for r in rows] == [0.5, 0.25, None, None, None]
    assert [r["of_disk"] for r in rows] == [None, None, 0.5, None, None]
    bench.add_speedups(rows)
    text = bench.format_rows(rows)
    assert "vs mlx-lm" in text and "0.25x" in text and "50%" in text


@pytest.mark.skipif(
    importlib.util.find_spec(shapes.DEMO_GGUF_HEADER_PACKAGE) is None,
    reason="shape: models take the demo package's tokenizer",
)
def test_bench_runs_on_a_shape_model(capsys, tmp_path, models_dir, monkeypatch):
    small = shapes.shape_config("qwen2.5-0.5b")
    small.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    small.update(num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setitem(shapes.SHAPES, "qwen2.5-0.5b", small)
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--model", "shape:qwen2.5-0.5b", "--block-size", "16"]
    argv += ["--lengths", "40", "--extend", "8", "--repeat", "2", "--json", str(out_json)]
    argv += ["--cache-dir", str(tmp_path / "kv"), "--data-dir", str(tmp_path / "data")]
    argv += ["--models-dir", str(models_dir)]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out_json.read_text())
    assert doc["device"] == out.splitlines()[0].rsplit(" · ", 1)[1]
    assert doc["device_info"]["dtype"] in doc["device"]
    assert doc["disk_read"]["nbytes"] > 0 and "disk sequential read" in out
    rows = {(r["system"], r["case"]): r for r in doc["rows"]}
    assert doc["repeat"] == 2 and all(len(r["ttft_runs_s"]) == 2 for r in doc["rows"])
    # every cold run was cold, every hit a hit. tierchat's exact hit is the whole prompt
    # (the resident cache and its kept logprobs); its nearest restore lands on the exact
    # common prefix (the folded schedule of a model without state layers)
    for system, exact, nearest in (("tierchat", 40, 40), ("mlx-lm LRU", 39, 40)):
        assert rows[(system, "cold")]["cached_runs"] == [0, 0]
        assert rows[(system, "exact hot")]["cached_runs"] == [exact, exact]
        assert rows[(system, "nearest hot")]["cached_runs"] == [nearest, nearest]
    # after a restart the whole prompt comes back too: its tail on the SSD tier kept the
    # first token's logprobs (40 is no multiple of the block size, so the prompt has one)
    assert rows[("tierchat", "exact ssd")]["cached_runs"] == [40, 40]
    assert rows[("tierchat", "exact ssd")]["prefill_tokens"] == 0
    assert rows[("tierchat", "exact ssd")]["of_disk"] > 0
    assert rows[("tierchat", "exact hot")]["vs_mlx_lm"] > 0
    assert rows[("mlx-lm LRU", "exact hot")]["prefill_tokens"] == 1
    assert rows[("tierchat", "exact hot")]["prefill_tokens"] == 0
