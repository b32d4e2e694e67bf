"""Publishing a directory built in steps (model conversions, tiny and shape models)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def staged_dir(target: Path, done: Callable[[Path], bool]) -> Iterator[Path]:
    """A new temp dir beside ``target`` (mode 0755) to build into; renamed to ``target``
    when the block ends without an error, so readers never see a half-built directory.

    ``done(target)`` says whether ``target`` is already complete: then another process
    finished the same build first and its copy is kept. An incomplete ``target`` (left by
    a crash) is replaced. The temp dir is removed in every case.

    Raises:
        OSError: the temp dir cannot be made, or the rename fails and ``target`` is still
            not complete.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700
    try:
        yield tmp
        if not done(target):
            shutil.rmtree(target, ignore_errors=True)
            try:
                os.rename(tmp, target)
            except OSError:  # another process won the race
                if not done(target):
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
