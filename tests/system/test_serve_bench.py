"""``tierchat bench --serve`` on tiny models: the replay through tierchat serve and
mlx_lm.server (a subprocess on 127.0.0.1) in one run."""

from __future__ import annotations

import pytest
from tierchat.cli.bench.serve import report, serve_bench
from tierchat.config.settings import Settings


def settings(model: str, tmp_path, models_dir) -> Settings:
    return Settings(
        model=model,
        models_dir=models_dir,
        cache_dir=tmp_path / "kv",
        data_dir=tmp_path / "data",
        block_size=16,
        hot_bytes=256 << 20,
    )


def test_tierchat_side_reuses_turns_restart_and_regenerate(tmp_path, models_dir):
    rows = serve_bench(
        settings("tiny:llama", tmp_path, models_dir), 2, 40, 8, baseline=False, log=lambda _: None
    )
    by = {r.label: r for r in rows}
    assert list(by) == ["turn 1", "turn 2", "restart", "regenerate"]
    assert by["turn 1"].prefilled == by["turn 1"].prompt_tokens
    assert by["turn 2"].cached_tokens >= by["turn 1"].prompt_tokens + 7
    # after the restart the whole conversation's full blocks come from the SSD tier
    history = by["turn 2"].prompt_tokens + by["turn 2"].completion_tokens
    assert by["restart"].cached_by["ssd"] >= history // 16 * 16
    assert by["regenerate"].prefilled == 0  # the resident cache and its kept logprobs
    assert "regenerate" in report(rows)


@pytest.mark.slow
def test_hybrid_against_mlx_lm_server(tmp_path, models_dir):
    rows = serve_bench(
        settings("tiny:qwen3_5", tmp_path, models_dir), 3, 150, 8, log=lambda _: None
    )
    ours = {r.label: r for r in rows if r.server == "tierchat"}
    theirs = {r.label: r for r in rows if r.server == "mlx-lm"}
    assert set(theirs) == set(ours)
    assert ours["regenerate"].prefilled == 1  # a hybrid: N-1 + 1
    assert theirs["restart"].prefilled == theirs["restart"].prompt_tokens  # no disk tier
    assert ours["restart"].prefilled * 5 <= theirs["restart"].prefilled
