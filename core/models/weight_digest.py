"""Content digests of weight files for the model fingerprint (docs/DESIGN.md §3).

A weight file rewritten in place can keep its size and mtime (``os.utime`` restores it),
so a fingerprint over those would keep serving the old model's K/V. The fingerprint hashes
each file's bytes instead. Hashing a large model at every start is slow, so each digest is
remembered in a sidecar file next to the weights (``.tierchat-digests.json``), keyed by the
file's size, mtime, ctime and inode: ctime cannot be set back by a user and moves with
every write, so a rewritten file gets a new key and is hashed again, and a file whose
stat matches its key is the file that was hashed. Where the sidecar cannot be written (a
read-only model dir), the digest is kept for the process only.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from ..files import temp_file

SIDECAR = ".tierchat-digests.json"
_memo: dict[tuple, str] = {}
_lock = threading.Lock()


def stat_key(path: Path) -> list[int]:
    """``[size, mtime_ns, ctime_ns, inode, device]`` of ``path`` (symlinks followed)."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_sha256(path: Path) -> str:
    """sha256 hex digest of the bytes of ``path`` (read in 4 MiB pieces)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_sidecar(folder: Path) -> dict:
    try:
        data = json.loads((folder / SIDECAR).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_sidecar(folder: Path, data: dict) -> None:
    try:
        with temp_file(folder / SIDECAR) as tmp:
            tmp.write_text(json.dumps(data, sort_keys=True))
            os.chmod(tmp, 0o600)
            os.replace(tmp, folder / SIDECAR)
    except OSError:
        pass  # a read-only model dir: the digest is remembered for this process only


def weight_digests(paths: list[Path]) -> list[str]:
    """The sha256 of each file of ``paths`` (all in one folder), read from the sidecar
    where its stat key still matches, else hashed (and the sidecar updated). Raises
    ``OSError`` when a file cannot be read."""
    if not paths:
        return []
    folder = paths[0].parent
    with _lock:
        saved = _read_sidecar(folder)
        out, changed = [], False
        for path in paths:
            key = stat_key(path)
            memo_key = (str(path), *key)
            entry = saved.get(path.name)
            if isinstance(entry, dict) and entry.get("key") == key and entry.get("sha256"):
                digest = str(entry["sha256"])
            elif memo_key in _memo:
                digest = _memo[memo_key]
            else:
                digest = file_sha256(path)
                if stat_key(path) != key:  # written while hashed: not remembered
                    out.append(digest)
                    continue
                _memo[memo_key] = digest
                saved[path.name] = {"key": key, "sha256": digest}
                changed = True
            out.append(digest)
        if changed:
            _write_sidecar(folder, saved)
    return out
