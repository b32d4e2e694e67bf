"""The engine's seams to its callers (docs/DESIGN.md §3, §15): one reading of a model's
config for its ``ModelInfo``, and the server's stop through ``EngineLike.shutdown`` (the
signal path drives no SSD tier itself). No model."""

from __future__ import annotations

import io
import shutil
from types import SimpleNamespace

from tierchat.cli.serve_shutdown import Shutdown
from tierchat.core.api import CacheStats, ModelInfo, TierStats, WritesFlushed
from tierchat.core.chat.context_limit import context_length
from tierchat.core.engine.runtime import auto_ssd_bytes, config_int, free_disk_bytes
from tierchat.core.engine.runtime import context_length as model_context_length
from tierchat.core.serve.limits import model_vocab


def model(args) -> SimpleNamespace:
    return SimpleNamespace(args=args)


def test_the_context_length_is_read_from_the_args_then_their_text_config():
    """One reader for both: a multimodal wrapper keeps the text model's figures in
    ``text_config`` (a dict or an object), and the args' own win where both say."""
    assert model_context_length(model(SimpleNamespace(max_position_embeddings=4096))) == 4096
    wrapped = SimpleNamespace(text_config={"max_position_embeddings": 262144, "vocab_size": 7})
    assert model_context_length(model(wrapped)) == 262144
    assert config_int(model(wrapped), ("vocab_size",)) == 7
    both = SimpleNamespace(n_ctx=2048, text_config=SimpleNamespace(max_position_embeddings=9))
    assert model_context_length(model(both)) == 2048
    assert model_context_length(model(SimpleNamespace(max_seq_len=True))) is None  # a bool
    assert model_context_length(SimpleNamespace()) is None


class InfoEngine:
    def __init__(self, info: ModelInfo | None) -> None:
        self.info = info


def test_callers_read_the_model_info_and_none_without_a_model():
    engine = InfoEngine(ModelInfo(8192, 151936, "cpu", "cpu (x), float32"))
    assert context_length(engine) == 8192 and model_vocab(engine) == 151936
    assert context_length(InfoEngine(None)) is None and model_vocab(InfoEngine(None)) is None
    assert model_vocab(InfoEngine(ModelInfo(None, 0, "cpu"))) is None  # 0: unknown


class StopEngine:
    """Records the stop it is asked for; its SSD writer had 3 entries queued."""

    writes_queued = 3

    def __init__(self) -> None:
        self.calls: list[tuple[float, bool]] = []

    def shutdown(self, timeout_s, *, close=True) -> WritesFlushed:
        self.calls.append((timeout_s, close))
        return WritesFlushed(queued=3, written=2, dropped=1)

    def stats(self) -> CacheStats:
        ssd = TierStats(entries=40, nbytes=3 << 30, max_bytes=16 << 30, evictions=5, write_drops=1)
        return CacheStats(ssd=ssd)


def stop(failure: str = "") -> tuple[StopEngine, dict, str]:
    state = SimpleNamespace(draining=False, abort_all=lambda why: 1)
    server = SimpleNamespace(stop=lambda timeout_s: None)
    engine, err = StopEngine(), io.StringIO()
    shutdown = Shutdown(state, server, engine, bound_s=7.5, err=err)
    if failure:
        shutdown.fail(failure)
    return engine, shutdown.run(), err.getvalue()


def test_a_signal_stops_the_engine_within_the_bound_through_its_shutdown():
    engine, report, err = stop()
    assert engine.calls == [(7.5, True)]
    assert report == {"streams": 1, "written": 2, "dropped": 1}
    assert "writing 3 queued SSD entries (at most 7.5 s)" in err
    # what a restart will find, said as the server stops
    assert (
        "SSD tier: 40 entries, 3.0 GiB of 16.0 GiB (5 evicted under the cap, 1 writes dropped"
        in err
    )
    assert "2 SSD entries written; 1 SSD entries not saved" in err


def test_failed_ranks_write_the_queue_but_leave_the_engine_thread():
    engine, report, _ = stop("rank 1 lost")
    assert engine.calls == [(7.5, False)] and report["written"] == 2


def test_the_automatic_ssd_cap_holds_a_whole_context_conversation():
    """16 GiB at least; one conversation at the model's whole context with its margin
    (Qwen3-8B, 131,072 tokens of bf16 K/V: 147,456 bytes a token); at most half the free
    disk, never below the floor."""
    floor = 16 << 30
    qwen3_8b = 147_456 * 131_072
    assert auto_ssd_bytes(0, 1 << 40) == floor
    assert auto_ssd_bytes(qwen3_8b, 1 << 40) == int(1.25 * qwen3_8b) > 24 * 10**9
    assert auto_ssd_bytes(qwen3_8b, 40 << 30) == 20 << 30  # half the free disk
    assert auto_ssd_bytes(qwen3_8b, 10 << 30) == floor  # a full disk shrinks it itself


def test_free_disk_bytes_reads_the_nearest_existing_folder(tmp_path, monkeypatch):
    seen = []

    def usage(path):
        seen.append(path)
        if not path.exists():
            raise FileNotFoundError(path)
        return SimpleNamespace(free=5 << 30)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    assert free_disk_bytes(tmp_path / "not" / "yet") == 5 << 30
    assert seen[-1] == tmp_path


def test_free_disk_bytes_counts_the_tiers_own_files_as_room(tmp_path, monkeypatch):
    """The SSD tier's own files are room it may keep: a restart after a long session must
    not shrink the automatic cap by what the session left on disk."""
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=1000))
    own = tmp_path / "tier"
    (own / "ab").mkdir(parents=True)
    (own / "ab" / "x.safetensors").write_bytes(b"1" * 300)
    (own / "y.json").write_bytes(b"2" * 20)
    (tmp_path / "other").write_bytes(b"3" * 50)  # another model's: not this tier's room
    assert free_disk_bytes(tmp_path, own) == 1000 + 320
    assert free_disk_bytes(tmp_path, tmp_path / "missing") == 1000
