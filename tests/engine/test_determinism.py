"""Issue 11 part 1: a replay's output is a function of the script, the seed and the
starting cache directory only, never of the SSD writer's progress.

The same script is replayed twice through ``tierchat replay`` (in-process) on empty cache
dirs, with the SSD writer slowed by a random delay before every write, a small hot tier
(so the SSD tier serves restores) and a short writer queue (so backpressure engages).
Every line's ``token_ids_sha256`` must agree, and so must where the cached tokens came
from: the lookup plan may not depend on which writes have finished.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tierchat.cli.main import main
from tierchat.core.cache.ssd.writer import SSDWriter

pytestmark = pytest.mark.usefixtures("isolated_settings")

TEXT = "Prefix caches keep the keys and values of earlier tokens so a new turn only pays "
SCRIPT = [
    {"op": "new", "system": "You are a terse assistant. " * 3},
    {"op": "user", "text": TEXT + "for what is new.", "max_tokens": 8},
    {"op": "regenerate", "max_tokens": 8},
    {"op": "regenerate", "max_tokens": 8, "temperature": 0.8},
    {"op": "user", "text": "And the SSD tier? " + TEXT, "max_tokens": 8},
    {"op": "edit", "turn": 1, "text": "And the hot tier? " + TEXT, "max_tokens": 8},
    {"op": "clear", "tier": "hot"},
    {"op": "user", "text": "After clearing the hot tier.", "max_tokens": 8},
    {"op": "edit", "turn": 0, "text": TEXT + "for what is old.", "max_tokens": 8},
    {"op": "restart"},
    {"op": "regenerate", "max_tokens": 8, "temperature": 0.8},
    {"op": "user", "text": "One more after a restart.", "max_tokens": 8},
]


def run(tmp_path: Path, models_dir: Path, capsys, tag: str, model: str) -> list[dict]:
    script = tmp_path / "script.jsonl"
    script.write_text("\n".join(json.dumps(op) for op in SCRIPT) + "\n")
    argv = [
        "replay",
        str(script),
        "--model",
        model,
        "--block-size",
        "16",
        "--hot-bytes",
        "64KB",
        "--seed",
        "7",
        "--cache-dir",
        str(tmp_path / f"kv-{tag}"),
        "--models-dir",
        str(models_dir),
    ]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize("model", ["tiny:llama", "tiny:gemma3"])
def test_cached_replays_with_a_randomly_slow_writer_agree(
    model, tmp_path, models_dir, capsys, monkeypatch
):
    monkeypatch.setenv("TIERCHAT_WRITER_QUEUE", "2")
    monkeypatch.setattr(SSDWriter, "write_jitter_s", 0.03)
    first = run(tmp_path, models_dir, capsys, "a", model)
    monkeypatch.setattr(SSDWriter, "write_delay_s", 0.01)
    second = run(tmp_path, models_dir, capsys, "b", model)
    *lines, summary = first
    assert len(lines) == sum(op["op"] in ("user", "regenerate", "edit") for op in SCRIPT)
    assert summary["summary"]["cached_by"]["ssd"] > 0  # the SSD tier did serve
    for a, b in zip(first[:-1], second[:-1], strict=True):
        assert a["op_index"] == b["op_index"]
        assert a["token_ids_sha256"] == b["token_ids_sha256"], a["op_index"]
        assert a["cached_by"] == b["cached_by"], a["op_index"]
