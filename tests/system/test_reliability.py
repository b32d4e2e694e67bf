"""Issue 12: cache files, the conversation store and the terminal under corruption,
crashes, full disks and hostile text. One test (or more) per numbered case."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_kit import assert_same, engine_maker, generate, make_engine, random_prompt
from ssd_kit import FP, entry
from tierchat.cli.chat import LineChat
from tierchat.cli.common import SSDWatch
from tierchat.cli.main import main
from tierchat.config.settings import SettingsError, load_settings
from tierchat.core.api import Finished, TokenBatch, TurnMetrics
from tierchat.core.cache.blocks import chain_ids
from tierchat.core.cache.ssd import format as ssd_format
from tierchat.core.cache.ssd import reader as ssd_reader
from tierchat.core.cache.ssd import tier as ssd_mod
from tierchat.core.cache.ssd.tier import SSDTier
from tierchat.core.cache.ssd.verifier import STALE_TMP_S
from tierchat.core.chat.sqlite import StoreError, store_error
from tierchat.core.chat.store import ConversationStore
from tierchat.core.memory import prefill as MP
from tierchat.core.memory import pressure as M
from tierchat.core.memory import readings as MR
from tierchat.core.text import printable

MODEL = "tiny:llama"
PROMPT = random_prompt(100, seed=3)


# ---------------------------------------------------------------- helpers


def write_file(dirpath: Path, name: str, meta: dict | list, tensors=()) -> Path:
    """A file with valid CRCs around arbitrary metadata (what a forger or a bug writes)."""
    body = {"__metadata__": {"hcrc": "0" * 8, "dcrc": "0" * 8}}
    if isinstance(meta, dict):
        body["__metadata__"].update(meta)
    raw = json.dumps(body, separators=(",", ":"))
    if not isinstance(meta, dict):  # metadata that is not an object after the CRC fields
        raw = raw[:-2] + ',"x":' + json.dumps(meta) + "}}"
    head = raw.encode()
    head += b" " * (-(8 + len(head)) % 8)
    head = len(head).to_bytes(8, "little") + head
    path = dirpath / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(ssd_format.seal_header(head, 0))
    return path


def stored(tmp_path: Path, n: int = 3) -> tuple[SSDTier, list]:
    ssd = SSDTier(tmp_path, FP, 1 << 30)
    es = [entry(i) for i in range(n)]
    for e in es:
        ssd.put(e)
    ssd.close()
    return ssd, es


def flip(path: Path, pos: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 1 << bit
    path.write_bytes(bytes(data))


@pytest.fixture
def engines(tmp_path, models_dir):
    with engine_maker(tmp_path, models_dir, MODEL) as make:
        yield make


@pytest.fixture
def cold(tmp_path, models_dir):
    e = make_engine(MODEL, tmp_path / "cold", models_dir, no_cache=True)
    yield generate(e, PROMPT)
    e.close()


# ---------------------------------------------------------------- 1. one flipped bit


def test_1_flipped_token_bit_in_a_header_is_corrupt_not_a_wrong_restore(engines, cold):
    first = engines()
    generate(first, PROMPT)
    first.close()
    bid = chain_ids(first.cache.root, PROMPT, 16, 3)[2]
    path = first.cache.ssd._path(bid)
    data = path.read_bytes()
    pos = data.index(b'"tokens":"[') + len(b'"tokens":"[') + 1
    flip(path, pos)  # one digit of one token id changes
    e = engines()
    hot, handle = generate(e, PROMPT)
    assert_same(*cold, hot, handle)
    s = e.stats().ssd
    assert s.corrupt == 1
    assert any("corrupt SSD entry" in t for _, t in e.stats().events)


def test_1_tokens_that_do_not_hash_to_the_id_are_refused(tmp_path):
    """Even with valid CRCs (a forger recomputed them): tokens must hash to the id."""
    ssd, es = stored(tmp_path)
    path = ssd._path(es[0].id)
    layout, _, _ = ssd_reader.read_file(path)
    meta = dict(layout.meta)
    meta["tokens"] = json.dumps([t + 1 for t in es[0].tokens], separators=(",", ":"))
    write_file(path.parent, path.name, {k: v for k, v in meta.items() if "crc" not in k})
    again = SSDTier(tmp_path, FP, 1 << 30)
    assert again.corrupt == 1 and es[0].id not in again and not path.exists()
    again.close()


def test_1_files_of_another_model_with_edited_strings_are_never_used(tmp_path):
    other = "cd" * 32
    theirs = SSDTier(tmp_path / "other", other, 1 << 30)
    e = entry(1)
    theirs.put(e)
    theirs.close()
    src = theirs._path(e.id).read_bytes()
    forged = src.replace(other.encode(), FP.encode())  # fingerprint edited, CRC now stale
    ours = SSDTier(tmp_path, FP, 1 << 30)
    ours.close()
    dst = ours._path(e.id)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(forged)
    again = SSDTier(tmp_path, FP, 1 << 30)
    assert again.corrupt == 1 and len(again) == 0 and not dst.exists()
    again.close()


# ---------------------------------------------------------------- 2. bad shape/dtype/offsets


@pytest.mark.parametrize("field", [b'"shape":[', b'"dtype":"', b'"data_offsets":['])
def test_2_flipped_bit_in_a_tensor_header_is_counted_and_removed(tmp_path, field):
    ssd, es = stored(tmp_path)
    path = ssd._path(es[1].id)
    flip(path, path.read_bytes().index(field) + len(field), 1)
    again = SSDTier(tmp_path, FP, 1 << 30)
    again.wait_verified()
    assert again.corrupt == 1 and not path.exists()
    assert again.load(es[1].id) is None  # no exception, a miss
    assert all(again.load(e.id) is not None for e in (es[0], es[2]))
    again.close()


def test_2_any_load_failure_is_a_counted_miss(tmp_path, monkeypatch):
    """A failure that is not the file's (an MLX or resource error) is a miss counted in
    ``errors``; only a checksum or format failure removes the file (issue 22 case 4)."""
    ssd, es = stored(tmp_path)
    again = SSDTier(tmp_path, FP, 1 << 30)
    again.wait_verified()

    def boom(layout, stage):
        raise RuntimeError("cannot map")

    with monkeypatch.context() as m:
        m.setattr(ssd_reader, "arrays_in", boom)
        assert again.load(es[0].id) is None
    assert again.errors == 1 and again.corrupt == 0
    assert es[0].id in again and again._path(es[0].id).exists()
    assert again.load(es[0].id) is not None  # retried later: it loads
    again.close()


def test_2_damaged_header_then_chat_equals_cold(engines, cold):
    first = engines()
    generate(first, PROMPT)
    first.close()
    bid = chain_ids(first.cache.root, PROMPT, 16, 2)[1]
    path = first.cache.ssd._path(bid)
    flip(path, path.read_bytes().index(b'"shape":[') + 9, 2)
    e = engines()
    e.cache.ssd.wait_verified()
    hot, handle = generate(e, PROMPT)
    assert_same(*cold, hot, handle)
    assert e.stats().ssd.corrupt == 1


# ---------------------------------------------------------------- 3. one bad entry, app starts


def test_3_scan_survives_every_kind_of_bad_path(tmp_path, monkeypatch):
    ssd, es = stored(tmp_path)
    shard = ssd._path(es[0].id).parent
    base = {
        k: v for k, v in ssd_reader.read_file(ssd._path(es[0].id))[0].meta.items() if "crc" not in k
    }
    write_file(shard, "a" * 64 + ".safetensors", [1, 2, 3])  # metadata not an object
    write_file(shard, "b" * 64 + ".safetensors", {k: v for k, v in base.items() if k != "id"})
    (shard / ("c" * 64 + ".safetensors")).mkdir()
    (shard / "x.1.tmp").mkdir()
    os.mkfifo(shard / ("d" * 64 + ".safetensors"))
    locked = write_file(tmp_path / FP[:16] / "ee", "e" * 64 + ".safetensors", {"x": "1"})
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):  # a non-writable shard dir (we may be root)
        if self.parent.name == "ee":
            raise PermissionError(13, "Permission denied", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    t0 = time.monotonic()
    again = SSDTier(tmp_path, FP, 1 << 30)  # a FIFO would hang here if it were opened
    assert time.monotonic() - t0 < 10
    assert again.enabled
    assert len(again) == 3  # the good entries
    assert again.corrupt == 5  # a list, no id, a directory, a FIFO, the locked one
    assert locked.exists() and again.errors >= 1  # the failed unlink: counted, not raised
    assert not (shard / ("d" * 64 + ".safetensors")).exists()  # the FIFO link removed
    assert (shard / "x.1.tmp").is_dir()
    again.close()


# ---------------------------------------------------------------- 4. escape injection

HOSTILE = "ok \x1b]0;pwned\x07 \x1b[31mred\x1b[0m \x9b31m \x00\x08\r done\n\tnext"


class _Turn:
    error = None

    def events(self):
        yield TokenBatch((1,), HOSTILE[:9])
        yield TokenBatch((2,), HOSTILE[9:])
        yield Finished((1, 2), HOSTILE, TurnMetrics(prompt_tokens=3, generation_tokens=2))

    def cancel(self):
        pass


class _Engine:
    def __init__(self, events=()):
        self.events = list(events)

    def stats(self):
        return type("S", (), {"events": tuple(self.events)})()


class _Session:
    def __init__(self, send=None):
        self.engine = _Engine()
        self._send = send

    def send(self, text):
        return self._send(text) if self._send else _Turn()


def test_4_no_control_byte_reaches_stdout():
    out, err = io.StringIO(), io.StringIO()
    LineChat(_Session(), io.StringIO("hello\n"), out, err).loop()
    text = out.getvalue()
    assert "assistant> " in text and "pwned" in text  # the text stays, the controls go
    assert not any(c in text for c in "\x1b\x07\x9b\x00\x08\r")
    assert "done\n\tnext" in text
    assert printable("a\x1b[2Jb\u0085c\n\td") == "a[2Jbc\n\td"


# ---------------------------------------------------------------- 5. permissions


def test_5_store_and_cache_dirs_are_owner_only(tmp_path):
    store = ConversationStore(tmp_path / "data" / "deep" / "conversations.sqlite")
    store.create_conversation("x")
    for d in (tmp_path / "data", tmp_path / "data" / "deep"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in Path(store.path).parent.iterdir():  # the file, -wal and -shm
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    store.close()
    ssd = SSDTier(tmp_path / "a" / "b" / "kv", FP, 1 << 20)
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "kv", ssd.dir):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    ssd.close()


def test_5_existing_store_file_is_tightened(tmp_path):
    path = tmp_path / "c.sqlite"
    ConversationStore(path).close()
    path.chmod(0o644)
    ConversationStore(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


# ---------------------------------------------------------------- 6. symlinks


def test_6_symlinked_shard_dir_is_never_followed(tmp_path):
    ssd, es = stored(tmp_path / "cache")
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.tmp").write_bytes(b"mine")
    (outside / ("f" * 64 + ".safetensors")).write_bytes(b"not yours")
    old = time.time() - 3600
    os.utime(outside / "keep.tmp", (old, old))
    link = ssd.dir / "ff"
    link.symlink_to(outside, target_is_directory=True)
    again = SSDTier(tmp_path / "cache", FP, 1 << 30)
    assert sorted(p.name for p in outside.iterdir()) == ["f" * 64 + ".safetensors", "keep.tmp"]
    assert (outside / "keep.tmp").read_bytes() == b"mine"
    assert not link.is_symlink() and len(again) == len(es)
    e = entry(5)
    e_path = again._path(e.id)
    again.close()
    assert not e_path.is_symlink()


# ---------------------------------------------------------------- 7. live temp files


def test_7_only_temp_files_of_dead_writers_or_old_ones_are_removed(tmp_path):
    ssd, es = stored(tmp_path)
    shard = ssd._path(es[0].id).parent
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        kept = shard / f"{'a' * 64}.{live.pid}.0.tmp"
        gone = shard / f"{'b' * 64}.{dead.pid}.0.tmp"
        stale = shard / f"{'c' * 64}.{live.pid}.1.tmp"
        for p in (kept, gone, stale):
            p.write_bytes(b"half a file")
        old = time.time() - 2 * STALE_TMP_S
        os.utime(stale, (old, old))
        SSDTier(tmp_path, FP, 1 << 30).close()
        assert kept.exists() and not gone.exists() and not stale.exists()
    finally:
        live.kill()
        live.wait()


# ---------------------------------------------------------------- 8. store errors


def test_8_full_disk_mid_chat_loses_only_that_turn(tmp_path):
    store = ConversationStore(tmp_path / "c.sqlite")
    cid = store.create_conversation("x")
    first = store.add_node(cid, None, "user", "fits")
    store._conn.execute("PRAGMA max_page_count = 1")  # the disk is now full for SQLite
    with pytest.raises(StoreError) as info:
        for _ in range(50):
            store.add_node(cid, first.id, "assistant", "x" * 20000)
    assert info.value.kind == "full" and "full" in str(info.value)
    assert store.active_path(cid)[0].content == "fits"  # reads go on
    store._conn.execute("PRAGMA max_page_count = 1000000")
    store.add_node(cid, first.id, "assistant", "room again")  # and writes, once there is room
    store.close()


def test_8_chat_says_why_a_turn_was_not_saved_and_goes_on():
    def fail(text):
        raise StoreError("c.sqlite: cannot save: the disk is full (database or disk is full)")

    out, err = io.StringIO(), io.StringIO()
    session = _Session(send=fail)
    LineChat(session, io.StringIO("one\ntwo\n"), out, err).loop()
    assert err.getvalue().count("turn not saved") == 2  # both lines tried: still running
    assert "disk is full" in err.getvalue()


@pytest.mark.parametrize(
    "code, kind, words",
    [
        ("SQLITE_FULL", "full", "disk is full"),
        ("SQLITE_READONLY_DBMOVED", "readonly", "read-only"),
        ("SQLITE_IOERR_WRITE", "ioerr", "I/O error"),
        ("SQLITE_CANTOPEN", "cantopen", "cannot be opened"),
        ("SQLITE_NOTADB", "corrupt", "not a tierchat conversation store"),
    ],
)
def test_8_sqlite_errors_are_named(code, kind, words):
    e = sqlite3.OperationalError("something")
    e.sqlite_errorname = code
    err = store_error(e, "conv.sqlite", "save")
    assert err.kind == kind and words in str(err) and "conv.sqlite" in str(err)


def test_8_read_only_store_at_start_is_not_called_foreign(tmp_path, monkeypatch):
    path = tmp_path / "c.sqlite"
    ConversationStore(path).close()

    real = sqlite3.connect

    def readonly(p, **kw):  # as root we cannot make a file unwritable; open it read-only
        return real(f"file:{p}?mode=ro", uri=True, **kw)

    monkeypatch.setattr(sqlite3, "connect", readonly)
    path.unlink()
    with pytest.raises(StoreError) as info:
        ConversationStore(path)
    assert "not a tierchat conversation store" not in str(info.value)
    assert info.value.kind in ("readonly", "cantopen")


# ---------------------------------------------------------------- 9. bad text


@pytest.mark.usefixtures("isolated_settings")
def test_9_invalid_unicode_in_a_script_is_rejected_up_front(tmp_path, capsys):
    script = tmp_path / "s.jsonl"
    script.write_text('{"op": "new"}\n{"op": "user", "text": "bad \\ud800 surrogate"}\n')
    assert main(["replay", str(script), "--model", MODEL]) == 2
    err = capsys.readouterr().err
    assert f"{script}:2:" in err and "surrogate" in err and "Traceback" not in err
    script.write_bytes(b'{"op": "new"}\n{"op": "new"}\n{"op": "user", "text": "\xff"}\n')
    assert main(["replay", str(script), "--model", MODEL]) == 2
    err = capsys.readouterr().err
    assert f"{script}:3: not valid UTF-8" in err


def test_9_config_that_is_not_utf8_names_the_file(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_bytes(b'model = "\xff"\n')
    with pytest.raises(SettingsError, match=str(cfg)):
        load_settings(config_path=cfg, env={})


def test_9_chat_reads_stdin_with_replacement(tmp_path, models_dir):
    env = {**os.environ, "TIERCHAT_CONFIG": str(tmp_path / "none.toml")}
    (tmp_path / "none.toml").write_text("")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    args = ["--model", MODEL, "--models-dir", str(models_dir), "--max-tokens", "24"]
    args += ["--cache-dir", str(tmp_path / "kv"), "--data-dir", str(tmp_path / "data")]
    proc = subprocess.run(
        [sys.executable, "-m", "tierchat.cli.main", "chat", *args],
        input=b"caf\xe9 \xff\xfe?\nsecond line\n",
        capture_output=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert proc.stdout.count(b"assistant> ") == 2  # both lines answered
    assert b"Traceback" not in proc.stderr
    assert not any(b in proc.stdout for b in (b"\x1b", b"\x07", b"\xc2\x9b"))


# ---------------------------------------------------------------- 11. refusals


def test_11_weights_over_the_limit_are_named():
    line = M.HardLine(int(0.92 * 200_000_000), 200_000_000, 0.92, in_use_bytes=450_000_000)
    err = MP.PrefillRefused(600_000_000, line, 32, new_tokens=10)
    msg = str(err)
    assert "weights" in msg and "429.2 MiB" in msg and "shorter prompt will not help" in msg
    assert "Try a shorter prompt" not in msg


def test_11_a_one_byte_limit_is_shown_as_given():
    class Reader:
        def read(self):
            return MR.MemoryReading(
                active=1000, peak=1000, system_total=8 << 30, system_available=4 << 30
            )

    mon = M.MemoryMonitor(limit_bytes=1, reader=Reader())
    err = MP.PrefillRefused(10_000, mon.hard_line(), 32)
    assert "of the 1 B limit" in str(err)


# ---------------------------------------------------------------- 12. silent SSD loss


def test_12_one_stderr_line_when_the_ssd_tier_shrinks():
    engine = _Engine([(1, "hot: evicted 3 entries")])
    watch = SSDWatch(engine)
    err = io.StringIO()
    assert watch.check(err) is None
    engine.events += [(2, "disk full: SSD cap shrunk to 1000 bytes")] * 1
    engine.events += [(3, "disk full: SSD cap shrunk to 1000 bytes")]
    assert watch.check(err) is not None
    assert watch.check(err) is None  # said once
    lines = err.getvalue().splitlines()
    assert lines == ["warning: SSD tier: disk full: SSD cap shrunk to 1000 bytes (2 events)"]


def test_12_disk_full_reaches_the_events_chat_reads(engines, monkeypatch):
    import errno as errno_mod

    real_open = os.open

    def full(path, flags, mode=0o777, **kw):
        if str(path).endswith(".tmp"):
            raise OSError(errno_mod.ENOSPC, "No space left on device")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(ssd_mod.os, "open", full)
    e = engines(ssd_admission=False)  # every entry written at once: the disk fills now
    generate(e, PROMPT)
    e.cache.ssd.flush()
    err = io.StringIO()
    line = SSDWatch(e).check(err)
    assert line is not None and "disk full" in line
