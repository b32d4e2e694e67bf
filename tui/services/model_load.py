"""Loading a model from the chat screen, and the device line of its header: the engine's
load events become messages (``tierchat.tui.messages``) posted to the screen; a local
path is checked before the engine is asked (docs/DESIGN.md §16). No MLX here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual.message import Message
from tierchat.core.api import EngineLike, Event, Failed, ModelLoaded, ModelLoading
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


def device_line(engine: EngineLike, given: str) -> str:
    """The device and compute dtype for the header ("gpu (…, metal), bfloat16"):
    ``given`` (the app's ``device``, from a caller), else the loaded model's
    (``ModelInfo.device_line``, read by the engine at load: the TUI never imports MLX)."""
    info = engine.info
    return given or (info.device_line if info is not None else "")
