"""Loading a model from the chat screen, and the device line of its header: the engine's
load events become messages (``tierchat.tui.messages``) posted to the screen; a local
path is checked before the engine is asked (docs/DESIGN.md §16). No MLX here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual.message import Message
from tierchat.core.api import Event, Failed, ModelLoaded, ModelLoading
from tierchat.tui.messages import ModelLoadAdvanced, ModelLoadFailed, ModelLoadFinished


def path_problem(spec: str) -> str:
    """Why ``spec``, given as a path, cannot be a model directory ("" when it may be)."""
    if not spec.startswith(("/", "./", "../", "~")):
        return ""
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        return ""
    return f"{spec}: {'no such directory' if not path.exists() else 'not a directory'}"


def load_events(spec: str, post: Callable[[Message], Any]) -> Callable[[Event], None]:
    """An ``on_event`` for ``engine.load_model(spec, ...)`` (engine thread): progress, the
    result and a failure become messages, nothing else."""

    def on_event(event: Event) -> None:
        if isinstance(event, ModelLoading):
            post(ModelLoadAdvanced(spec, event.done, event.total, event.message))
        elif isinstance(event, ModelLoaded):
            post(ModelLoadFinished(event.model, event.warning))
        elif isinstance(event, Failed):
            post(ModelLoadFailed(spec, event.message))

    return on_event


def device_line(engine: Any, given: str) -> str:
    """The device and compute dtype for the header ("gpu (…, metal), bfloat16").

    ``core.engine.device`` imports MLX, which the TUI never does itself: the line is read
    only when MLX is already loaded (by the real engine); ``given`` (the app's ``device``,
    from a caller) or an engine's own ``describe_device()`` take precedence."""
    describe = getattr(engine, "describe_device", None)
    try:
        if callable(describe):
            return str(describe())
        real = type(engine).__module__.startswith("tierchat.core")
        if not given and real and "mlx.core" in sys.modules:
            from tierchat.core.engine.device import describe_device

            given = describe_device()
    except Exception:  # noqa: BLE001 - a header detail, never a crash
        pass
    return given
