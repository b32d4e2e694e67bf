"""Edit a text in the user's editor (``$VISUAL``, else ``$EDITOR``, else ``vi``), as git
and most terminal programs do: write it to a private temporary file, run the editor on
it, read it back. The caller hands the terminal over first (``App.suspend`` in the TUI).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path


class EditorError(RuntimeError):
    """The editor could not be started, or exited with a non-zero status."""


def editor_command(env: Mapping[str, str] | None = None) -> list[str]:
    """The editor's argv from ``$VISUAL`` or ``$EDITOR`` (split as a shell would, so
    ``"code --wait"`` works), ``["vi"]`` when neither is set."""
    env = os.environ if env is None else env
    for name in ("VISUAL", "EDITOR"):
        value = env.get(name, "").strip()
        if value:
            return shlex.split(value)
    return ["vi"]


def edit_text(text: str, *, command: list[str] | None = None, suffix: str = ".md") -> str:
    """``text`` after the user edited it: written to a 0600 temporary file, the editor
    (``command``, default :func:`editor_command`) run on it in the foreground, the file
    read back (UTF-8) and removed. A trailing newline the editor adds is dropped.

    Raises :class:`EditorError` when the editor is missing or exits non-zero (the text is
    then left as it was)."""
    argv = list(command or editor_command())
    fd, name = tempfile.mkstemp(prefix="tierchat-", suffix=suffix)
    path = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            done = subprocess.run([*argv, str(path)], check=False)
        except OSError as e:
            raise EditorError(f"cannot run the editor {argv[0]!r}: {e.strerror or e}") from None
        if done.returncode != 0:
            raise EditorError(
                f"the editor {argv[0]!r} exited with status {done.returncode}; "
                "the message is unchanged"
            )
        edited = path.read_text(encoding="utf-8")
    finally:
        path.unlink(missing_ok=True)
    return edited[:-1] if edited.endswith("\n") and not text.endswith("\n") else edited
