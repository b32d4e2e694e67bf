"""What every subcommand shares: the error type, stderr messages, engine start-up.

Nothing here imports MLX at module level: ``tierchat models`` and ``tierchat config``
stay light. :func:`start_engine` imports the engine (and so MLX) when first called.
"""

from __future__ import annotations

import sys
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and something failed (a model load, a generation)
EXIT_USAGE = 2  # bad input: flags, settings, a script, a missing file
EXIT_INTERRUPTED = 130


class CLIError(Exception):
    """An error to report as one ``error: ...`` line on stderr, exiting with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    text = message if message.startswith("warning:") else f"warning: {message}"
    print(text, file=sys.stderr, flush=True)


def open_store(path, busy_s: float | None = None):
    """The conversation store at ``path``; a bad or unwritable file is a :class:`CLIError`.
    ``busy_s``: how long an operation waits for another process's lock (the
    ``store_busy_s`` setting; None: the store's default).

    The default data dir (created 0755 by tierchat before 0.2) is tightened to 0700."""
    from pathlib import Path

    from tierchat.config.settings import user_data_dir
    from tierchat.core.chat.sqlite import StoreError
    from tierchat.core.chat.store import ConversationStore
    from tierchat.core.files import private_dirs

    try:
        data_dir = Path(path).parent
        if data_dir == user_data_dir() and data_dir.is_dir():
            private_dirs(data_dir, tighten=True)
    except OSError:
        pass
    try:
        if busy_s is None:
            return ConversationStore(path)
        return ConversationStore(path, busy_timeout_s=busy_s)
    except StoreError as e:
        raise CLIError(str(e)) from None
    except OSError as e:
        raise CLIError(
            f"cannot open the conversation store {path}: {e.strerror or e} (use --data-dir)"
        ) from None


def new_session(engine: Any, store: Any, settings: Any, *, swipes: bool = True):
    """:meth:`ChatSession.from_settings <tierchat.core.chat.session.ChatSession.from_settings>`."""
    from tierchat.core.chat.session import ChatSession

    return ChatSession.from_settings(engine, store, settings, swipes=swipes)


def _load_progress(spec: str):
    """A ``ModelLoading`` callback drawing one updating line on stderr when it is a tty."""
    from tierchat.core.api import ModelLoading

    tty = sys.stderr.isatty()

    def on_event(event: Any) -> None:
        if tty and isinstance(event, ModelLoading):
            total = max(event.total, 1)
            msg = f" {event.message}" if event.message else ""
            print(f"\rloading {spec}: {event.done}/{total}{msg}\033[K", end="", file=sys.stderr)

    return on_event, tty


def start_engine(settings: Any, model: str | None = None, *, quiet: bool = False):
    """A new :class:`~tierchat.core.engine.engine.Engine` with ``model`` (default
    ``settings.model``) loaded. A load warning (SSD tier off, caching unsupported for the
    model) goes to stderr unless ``quiet``.

    Raises :class:`CLIError` when the model cannot be loaded; the engine is closed then
    (and on Ctrl-C). The caller closes the returned engine.
    """
    from tierchat.core.api import Failed
    from tierchat.core.engine.engine import Engine

    spec = model or settings.model
    engine = Engine(settings)
    try:
        on_event, tty = _load_progress(spec)
        result = engine.load_model(spec, on_event=on_event).wait()
        if tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
    except BaseException:
        engine.close()
        raise
    if isinstance(result, Failed):
        engine.close()
        raise CLIError(result.message)
    if result.warning and not quiet:
        warn(result.warning)
    return engine


def check_cache_owner(settings: Any) -> None:
    """Refuse to run an engine on a cache dir another process owns (docs/DESIGN.md §8.4).

    Raises :class:`CLIError` naming the owner; nothing with ``--no-cache``."""
    from tierchat.core.live_status import owner_message

    if getattr(settings, "no_cache", False):
        return
    busy = owner_message(settings.cache_dir)
    if busy is not None:
        raise CLIError(busy)


def table(rows: list[tuple], headers: tuple[str, ...] | None = None) -> str:
    """Rows as left-aligned text columns (numbers right-aligned), two spaces apart."""
    cells = [[str(c) for c in r] for r in rows]
    if headers:
        cells.insert(0, list(headers))
    if not cells:
        return ""
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(cells[0]))]
    numeric = [
        all(_is_number(r[i]) for r in cells[1 if headers else 0 :] if i < len(r))
        for i in range(len(widths))
    ]
    lines = []
    for r in cells:
        parts = [c.rjust(widths[i]) if numeric[i] else c.ljust(widths[i]) for i, c in enumerate(r)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
    except ValueError:
        return text in ("-", "n/a")
    return True


# cache events that mean the SSD tier lost capacity or turned off (core/cache/ssd/tier.py)
SSD_LOSS_MARKERS = ("disk full: SSD cap shrunk", "SSD tier off", "SSD write failed")
SSD_LOSS_MARKERS += ("cannot read", "cannot verify", "retrying writes")


class SSDWatch:
    """Turns the engine's cache events into at most one stderr line per change: the SSD
    tier turning off, shrinking on a full disk, or failing writes (docs/DESIGN.md §8.4)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seen = 0
        self.last = ""

    def check(self, err: Any = None) -> str | None:
        """Print (to ``err``, default stderr) and return the new line, if any."""
        try:
            events = self.engine.stats().events
        except Exception:  # noqa: BLE001 -- a closed engine has nothing to say
            return None
        new = [(n, t) for n, t in events if n > self.seen]
        if new:
            self.seen = new[-1][0]
        lost = [t for _, t in new if any(m in t for m in SSD_LOSS_MARKERS)]
        if not lost:
            return None
        text = lost[-1].removeprefix("warning: ")
        line = f"warning: SSD tier: {text}" + (f" ({len(lost)} events)" if len(lost) > 1 else "")
        if text == self.last:
            return None
        self.last = text
        print(line, file=err or sys.stderr, flush=True)
        return line
