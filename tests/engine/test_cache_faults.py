"""Faults of the SSD tier: nothing corrupt is ever loaded, and chat always goes on."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
from engine_kit import assert_same, engine_maker, generate, make_engine, random_prompt
from tierchat.core.cache.blocks import chain_ids
from tierchat.core.cache.ssd.tier import RECONCILE_EVERY_S

MODEL = "tiny:llama"
PROMPT = random_prompt(100, seed=3)


@pytest.fixture
def engines(tmp_path, models_dir):
    # the writer's faults need writes: every entry at once (write-through)
    with engine_maker(tmp_path, models_dir, MODEL, ssd_admission=False) as make:
        yield make


@pytest.fixture
def cold(engines, tmp_path, models_dir):
    e = make_engine(MODEL, tmp_path / "cold", models_dir, no_cache=True)
    yield generate(e, PROMPT)
    e.close()


def ssd_files(engine):
    return sorted(engine.cache.ssd.dir.glob("*/*.safetensors"))


def block_file(engine, j):
    bid = chain_ids(engine.cache.root, PROMPT, 16, j + 1)[j]
    return engine.cache.ssd._path(bid)


def fill_and_restart(engines):
    e = engines()
    generate(e, PROMPT)
    e.close()
    return e


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "garbage_data"])
def test_damaged_block_is_skipped_counted_removed(engines, cold, damage):
    first = fill_and_restart(engines)
    path = block_file(first, 2)
    data = path.read_bytes()
    if damage == "truncate":
        damaged = data[: len(data) // 2]
    elif damage == "garbage_header":
        damaged = os.urandom(len(data))
    else:  # same size, valid header, tensor bytes overwritten: only the checksum sees it
        damaged = data[:-64] + os.urandom(64)
    path.write_bytes(damaged)
    e = engines()
    hot, handle = generate(e, PROMPT)
    assert_same(*cold, hot, handle)
    assert e.stats().ssd.corrupt >= 1
    e.cache.ssd.flush()  # the block is recomputed and stored again, healthy
    assert not path.exists() or path.read_bytes() != damaged
    # blocks before the damaged one still served (promoted to hot by the first attempt)
    assert hot.metrics.cached_by["ssd"] + hot.metrics.cached_by["hot"] >= 32


def test_blocks_read_before_a_corrupt_one_count_as_ssd(engines, cold):
    """The first attempt reads blocks 0 and 1 from their files (promoting them to hot),
    then finds block 2 corrupt; the retry takes 0 and 1 from RAM. They were read from SSD
    in this turn: ``cached_by`` says so, and the hot tier counts no hit for them."""
    fill_and_restart(engines)
    e = engines(choose_recompute=False)  # restore what the tiers hold, never recompute
    assert e.cache.ssd.wait_verified(60)  # the start-up check finds nothing wrong yet
    path = block_file(e, 2)
    data = path.read_bytes()
    path.write_bytes(data[:-64] + os.urandom(64))  # header intact: only the CRC sees it
    before = e.stats()
    hot, handle = generate(e, PROMPT)
    assert_same(*cold, hot, handle)
    after = e.stats()
    assert after.ssd.corrupt == before.ssd.corrupt + 1
    read_from_files = (after.ssd.hits - before.ssd.hits) * 16
    assert read_from_files == 32  # blocks 0 and 1, each read once
    assert hot.metrics.cached_tokens == 32
    assert hot.metrics.cached_by["ssd"] == read_from_files
    assert hot.metrics.cached_by["hot"] == 0
    assert after.hot.hits == before.hot.hits


def test_files_removed_behind_the_tier_leave_its_figures(engines):
    """Entry files deleted by hand leave ``ssd.entries`` and ``ssd.nbytes`` at the next
    check of the folder (at most every RECONCILE_EVERY_S seconds, on the tier's clock),
    without a read of those entries."""
    fill_and_restart(engines)
    e = engines()
    ssd = e.cache.ssd
    assert ssd.wait_verified(60)
    before = e.stats().ssd
    files = ssd_files(e)
    assert before.entries == len(files) > 3
    gone = files[-3:]
    gone_bytes = sum(p.stat().st_size for p in gone)
    for p in gone:
        p.unlink()
    now = [ssd.reconciled_at + RECONCILE_EVERY_S - 1]
    ssd.clock = lambda: now[0]
    assert e.stats().ssd.entries == before.entries  # checked too recently
    now[0] += 1
    after = e.stats()
    assert after.ssd.entries == len(ssd_files(e)) == before.entries - 3
    assert after.ssd.nbytes == before.nbytes - gone_bytes
    assert (after.ssd.hits, after.ssd.errors, after.ssd.corrupt) == (
        before.hits,
        before.errors,
        before.corrupt,
    )
    assert any("3 entries missing from disk" in text for _, text in after.events)


def test_temp_files_of_a_killed_writer_are_removed(engines):
    first = fill_and_restart(engines)
    shard = block_file(first, 0).parent
    # a writer that is gone: a pid that just exited (a fixed pid may be a live process)
    writer = subprocess.Popen([sys.executable, "-c", "pass"])
    writer.wait()
    tmp = shard / f"deadbeef.{writer.pid}.tmp"
    tmp.write_bytes(b"half a file")
    engines()
    assert not tmp.exists()


def test_foreign_model_entry_is_never_used(engines, tmp_path, models_dir, cold):
    other = make_engine("tiny:qwen2", tmp_path, models_dir)
    generate(other, PROMPT)
    other.close()
    first = fill_and_restart(engines)
    # plant the other model's files in this model's directory under this model's names
    foreign = sorted(other.cache.ssd.dir.glob("*/*.safetensors"))
    ours = ssd_files(first)
    for src, dst in zip(foreign, ours, strict=False):
        dst.write_bytes(src.read_bytes())
    e = engines()
    assert e.stats().ssd.corrupt >= 1
    hot, handle = generate(e, PROMPT)
    assert_same(*cold, hot, handle)


def test_disk_full_shrinks_cap_and_chat_goes_on(engines, cold, monkeypatch):
    import tierchat.core.cache.ssd.tier as ssd_mod

    real_open = os.open
    calls = {"n": 0}

    def full_disk(path, flags, mode=0o777):
        if str(path).endswith(".tmp"):
            calls["n"] += 1
            if calls["n"] > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, mode)

    monkeypatch.setattr(ssd_mod.os, "open", full_disk)
    e = engines()
    hot, handle = generate(e, PROMPT)
    e.cache.ssd.flush()
    s = e.stats().ssd
    assert s.errors >= 1
    assert s.max_bytes <= s.nbytes + 1
    assert_same(*cold, hot, handle)
    e.clear("resident")
    again, handle2 = generate(e, PROMPT)  # the hot tier still serves
    assert again.metrics.prefill_tokens == 1 and again.metrics.cached_by["hot"] == 99
    assert not list(e.cache.ssd.dir.glob("*/*.tmp"))


def test_unwritable_cache_dir_turns_ssd_off(tmp_path, models_dir, cold):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache dir should be")
    e = make_engine(MODEL, tmp_path, models_dir, cache_dir=blocker / "kv")
    try:
        s = e.stats()
        assert s.ssd.enabled is False and "not writable" in s.ssd.reason
        hot, handle = generate(e, PROMPT)
        assert_same(*cold, hot, handle)
        again, _ = generate(e, PROMPT)
        assert again.metrics.cached_by["hot"] > 0
    finally:
        e.close()


def test_slow_writer_backpressure_loses_nothing(engines):
    """A writer behind by ``writer_queue`` entries makes ``put`` wait; nothing is dropped,
    and every accepted entry is visible to lookups before it is written."""
    e = engines(writer_queue=2)
    e.cache.ssd.writer.write_delay_s = 0.05
    for seed in range(4):
        generate(e, random_prompt(120, seed=seed + 10), max_tokens=2)
        assert e.stats().ssd.queue_depth <= 2
    s = e.stats().ssd
    assert s.write_drops == 0 and e.cache.ssd.backpressure_waits > 0
    assert s.entries == s.saves_queued
    e.cache.ssd.flush()
    s = e.stats().ssd
    assert s.saves_persisted == s.saves_queued and s.queue_depth == 0


def test_clearing_ssd_then_chatting_persists_again(engines, cold):
    """Write-through is repaired: hot entries used after an SSD clear are written again."""
    e = engines()
    generate(e, PROMPT)
    e.clear("ssd")
    assert e.stats().ssd.entries == 0
    cont = PROMPT + random_prompt(20, seed=9)
    generate(e, cont)
    e.close()
    again = engines()
    hot, handle = generate(again, PROMPT)
    assert_same(*cold, hot, handle)
    assert hot.metrics.cached_tokens == 99 and hot.metrics.cached_by["ssd"] >= 96


# ---------------------------------------------------------------- fault injection (issue 12)

FAULT_SCRIPT = [
    {"op": "new", "system": "You are a terse assistant."},
    {"op": "user", "text": "Tell me about prefix caches in a few words please.", "max_tokens": 6},
    {"op": "regenerate", "max_tokens": 6},
    {"op": "user", "text": "And what about the SSD tier, and its files?", "max_tokens": 6},
    {"op": "edit", "turn": 1, "text": "And the hot tier?", "max_tokens": 6},
    {"op": "restart"},
    {"op": "user", "text": "Once more after a restart.", "max_tokens": 6},
    {"op": "regenerate", "max_tokens": 6},
]


def _replay(capsys, script, models_dir, cache_dir, *extra):
    import json

    from tierchat.cli.main import main

    argv = ["replay", str(script), "--model", MODEL, "--block-size", "16"]
    argv += ["--models-dir", str(models_dir), "--cache-dir", str(cache_dir), *extra]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()][:-1]


@pytest.mark.usefixtures("isolated_settings")
def test_one_flipped_bit_in_every_file(tmp_path, models_dir, capsys, monkeypatch):
    """Flip one random bit in every SSD file of a finished replay. Rerun: every line's
    tokens equal cold. Restart: the corrupt count equals the number of files flipped."""
    import json
    import random
    import shutil

    from tierchat.core.cache.ssd.io import read_file
    from tierchat.core.cache.ssd.tier import SSDTier

    script = tmp_path / "s.jsonl"
    script.write_text("\n".join(json.dumps(op) for op in FAULT_SCRIPT) + "\n")
    cold = _replay(capsys, script, models_dir, tmp_path / "cold", "--no-cache")
    kv = tmp_path / "kv"
    first = _replay(capsys, script, models_dir, kv)
    assert [x["token_ids_sha256"] for x in first] == [x["token_ids_sha256"] for x in cold]

    files = sorted(kv.rglob("*.safetensors"))
    assert len(files) > 10
    fingerprint = read_file(files[0])[0].meta["fingerprint"]
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for path in files:
        data = bytearray(path.read_bytes())
        pos = rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    shutil.copytree(kv, tmp_path / "kv-copy")

    # the load path alone must catch every flip: no start-up verifier
    monkeypatch.setattr(SSDTier, "verify_at_start", False)
    again = _replay(capsys, script, models_dir, kv)
    for a, b in zip(again, cold, strict=True):
        assert a["token_ids_sha256"] == b["token_ids_sha256"], (seed, a["op_index"])

    monkeypatch.setattr(SSDTier, "verify_at_start", True)
    restarted = SSDTier(tmp_path / "kv-copy", fingerprint, 1 << 30)
    assert restarted.wait_verified(60)
    assert restarted.corrupt == len(files), seed
    assert len(restarted) == 0
    restarted.close()


def test_running_out_of_file_descriptors_deletes_no_cache_file(engines, cold, monkeypatch):
    """Issue 22 case 4: EMFILE at start (the scan) and at a load is a resource error, not
    corruption: counted and logged, every file kept, the turn a miss equal to cold."""
    import tierchat.core.cache.ssd.tier as ssd_mod

    first = fill_and_restart(engines)
    files = {p: p.read_bytes() for p in ssd_files(first)}
    assert files
    real_open = os.open
    fds = {"out": True}

    def no_fds(path, flags, mode=0o777, **kw):
        if fds["out"] and str(path).endswith(".safetensors"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(ssd_mod.os, "open", no_fds)
    e = engines()  # the scan cannot open a file: none indexed, none removed
    s = e.stats().ssd
    assert s.entries == 0 and s.corrupt == 0 and s.errors == len(files)
    assert {p: p.read_bytes() for p in ssd_files(e)} == files
    e.close()

    fds["out"] = False
    e = engines()
    assert e.cache.ssd.wait_verified(60) and e.stats().ssd.entries == len(files)
    fds["out"] = True  # now loads fail: a miss each, the files stay indexed
    hot, handle = generate(e, PROMPT)
    assert_same(*cold, hot, handle)
    s = e.stats().ssd
    assert s.corrupt == 0 and s.errors > 0 and s.entries >= len(files)
    assert any("Too many open files" in t for _, t in e.stats().events)
    assert all(p.read_bytes() == data for p, data in files.items())
    e.close()

    fds["out"] = False  # descriptors back: a restart restores from the same files
    e = engines()
    again, handle = generate(e, PROMPT)
    assert_same(*cold, again, handle)
    assert again.metrics.cached_by["ssd"] > 0 and e.stats().ssd.corrupt == 0
