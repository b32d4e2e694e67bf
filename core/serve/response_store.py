"""Stored Responses API responses, for ``previous_response_id`` and ``GET
/v1/responses/{id}`` (docs/DESIGN.md §15).

One JSON file per response, ``<id>.json``, in an owner-only dir (0700; files 0600, as
they hold whole conversations): ``{"input": [items], "output": [items], "response":
{...}}``, where ``input`` is the resolved conversation before the reply (a previous
response's input and output included, ``instructions`` not: OpenAI does not carry them
over). A file is written to a temp name beside it and renamed (never through a link), so a
reader never sees half a file; a temp left by a killed process is removed at the next
start (:func:`~tierchat.core.files.remove_stale_temps`). The store keeps the newest
``max_entries`` files within ``max_bytes``; the oldest (by mtime) go first.

A missing, unreadable or corrupt file is a 404 :class:`APIError` that says which, never
a 500; an id that is not one of ours (``resp_`` + 32 hex digits) is never a path.
"""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from pathlib import Path
from typing import Any

from ..files import private_dirs, private_open, remove_stale_temps, temp_prefix
from .prompts import APIError

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")
MAX_ENTRIES = 256
MAX_BYTES = 256 << 20
MAX_FILE_BYTES = 64 << 20  # a file larger than this is not read (not one we wrote)


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


class ResponseStore:
    """The stored responses under ``path`` (created 0700 on the first save)."""

    def __init__(
        self, path: str | os.PathLike, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES
    ) -> None:
        self.path = Path(path)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        if self.path.is_dir():
            remove_stale_temps(self.path)

    def save(self, response_id: str, record: dict[str, Any]) -> None:
        """Write ``record`` as response ``response_id``, then drop the oldest past the
        bounds. Raises :class:`OSError` (full or read-only disk) or :class:`ValueError`
        (not one of our ids)."""
        if not RESPONSE_ID.match(response_id):
            raise ValueError(f"not a response id: {response_id!r}")
        body = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        with self._lock:
            private_dirs(self.path, tighten=True)
            target = self.path / f"{response_id}.json"
            tmp = self.path / (temp_prefix(target.name) + uuid.uuid4().hex[:8])
            try:
                with private_open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL) as f:
                    f.write(body)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            self._prune()

    def _prune(self) -> None:
        entries = []
        for p in self.path.iterdir():
            if p.suffix == ".json" and RESPONSE_ID.match(p.stem):
                try:
                    st = p.lstat()
                except OSError:
                    continue
                entries.append((st.st_mtime_ns, p.name, st.st_size, p))
        entries.sort(reverse=True)  # newest first
        total = 0
        for k, (_, _, size, p) in enumerate(entries):
            total += size
            if k >= self.max_entries or (k > 0 and total > self.max_bytes):
                p.unlink(missing_ok=True)

    def load(self, response_id: str, param: str | None = None) -> dict[str, Any]:
        """The record of ``response_id``. Raises :class:`APIError` 404 when it is not
        stored, or its file cannot be read or is not a record of ours (the message says
        which); ``param`` names the body field that gave the id."""
        code = "previous_response_not_found" if param else "not_found"
        shown = response_id[:64]

        def missing(why: str) -> APIError:
            return APIError(f"response {shown!r} {why}", 404, param=param, code=code)

        if not RESPONSE_ID.match(response_id):
            raise missing("is not a response id of this server")
        path = self.path / f"{response_id}.json"
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise missing("was not found (not stored, or dropped as the oldest)") from None
        except OSError as e:
            raise missing(f"is stored but cannot be read ({e.strerror})") from None
        try:
            with open(fd, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
            if len(raw) > MAX_FILE_BYTES:
                raise ValueError("too large")
            record = json.loads(raw)
        except (OSError, ValueError):
            raise missing("is stored but its file is corrupt") from None
        if not (
            isinstance(record, dict)
            and isinstance(record.get("input"), list)
            and isinstance(record.get("output"), list)
            and isinstance(record.get("response"), dict)
        ):
            raise missing("is stored but its file is corrupt")
        return record
