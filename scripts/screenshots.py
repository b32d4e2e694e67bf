"""Regenerate the README screenshots of the TUI: SVG always, PNG where a converter exists.

    python scripts/screenshots.py            # real engine, model `demo` (CPU: a few minutes)
    python scripts/screenshots.py --fake     # the test fake engine, seconds, no MLX
    python scripts/screenshots.py --model tiny:llama --out /tmp/shots

The store and the KV cache live in a temporary directory, so every run starts cold and
your conversations are untouched; converted models are reused from the user cache dir.
PNGs are written with ``cairosvg`` when importable, else ``rsvg-convert`` when on PATH.

Every state is shot at 200×50 (``<state>.svg``: panels beside the chat) and at 100×30
(``<state>-100x30.svg``: the panels fold into a one-line summary; F2 shows them).

States: the empty app; a three-way swipe; the panels after cache hits; an edited message
with its branches under the message cursor; the conversation settings; the clear-confirm
modal; the command palette; the panels of a model the cache cannot handle (always the
fake engine with ``supported=False``: every real model family is supported); an error
notification (a failed model load); a tool round: the approval dialog, then the call and its
result in the transcript (always the fake engine speaking ``tiny:qwen2``'s tokenizer with a
recorded call, on the MCP test server of ``tests/mcp_kit.py``: a real model calls tools
when it likes).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES: dict[str, tuple[int, int]] = {"": (200, 50), "-100x30": (100, 30)}
FIXED_EPOCH = 1_767_225_600.0  # 2026-01-01 00:00 UTC: stable timestamps in the list


def make_settings(model: str, tmp: Path):
    from tierchat.config.settings import load_settings

    settings = load_settings({"model": model, "max_tokens": 48})
    settings.data_dir = tmp / "data"
    settings.cache_dir = tmp / "kv"
    return settings


def make_engine(args: argparse.Namespace, settings, *, supported: bool = True):
    if args.fake or not supported:
        sys.path.insert(0, str(ROOT / "tests"))
        from fakes import FakeEngine

        name = args.model if supported else "tiny:unknown-arch"
        return FakeEngine(name, supported=supported)
    from tierchat.core.engine.engine import Engine

    return Engine(settings)  # the app loads settings.model itself, with progress


async def settle(pilot, timeout_s: float) -> None:
    """Wait for the engine, the workers and the message queues to go quiet."""
    app = pilot.app
    screen = app.screen_stack[0]
    deadline = time.monotonic() + timeout_s
    while True:
        await pilot.pause()
        await app.workers.wait_for_complete()
        if not screen.streaming and not screen.loading_model:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("the app did not settle")
        await asyncio.sleep(0.05)
    await pilot.pause()


async def send(pilot, text: str, timeout_s: float) -> None:
    from tierchat.tui.widgets.chat_input import ChatInput

    box = pilot.app.screen_stack[0].query_one(ChatInput)
    box.focus()
    box.insert(text)
    await pilot.press("enter")
    await settle(pilot, timeout_s)


Steps = Callable[..., Awaitable[None]]


async def empty(pilot, t):
    pass


async def three_way_swipe(pilot, t):
    await send(pilot, "Explain prefix caching in two sentences.", t)
    for _ in range(2):
        await pilot.press("ctrl+r")
        await settle(pilot, t)
    await pilot.press("alt+left")


async def panels_after_hits(pilot, t):
    await send(pilot, "What is a KV cache? One line.", t)
    await send(pilot, "And a prefix cache?", t)
    await pilot.press("ctrl+r")


async def branches(pilot, t):
    await send(pilot, "What is a KV cache? One line.", t)
    await send(pilot, "And a prefix cache?", t)
    await pilot.press("escape", "up", "e")  # the message cursor: edit the last question
    await pilot.pause(0.2)
    pilot.app.screen.query_one("#edit-area").load_text("And a radix tree, as in SGLang?")
    await pilot.press("ctrl+s")
    await settle(pilot, t)
    await pilot.press("escape", "up")  # the cursor on the edited message: ◀ 2/2 ▶


async def settings_dialog(pilot, t):
    await send(pilot, "Hello", t)
    await pilot.press("f9")
    await pilot.pause(0.2)
    pilot.app.screen.query_one("#system").load_text("Answer in one short line.")
    pilot.app.screen.query_one("#temperature").value = "0.7"


async def panels_narrow(pilot, t):
    await panels_after_hits(pilot, t)
    await settle(pilot, t)
    if pilot.app.size.width < 140:
        await pilot.press("f2")  # narrow: the panels in place of the conversation list


async def clear_confirm(pilot, t):
    await send(pilot, "Fill the cache a little.", t)
    await settle(pilot, t)
    pilot.app.clear_notifications()
    await pilot.press("f8")


async def command_palette(pilot, t):
    await pilot.press("ctrl+p", *"Cache")
    await pilot.pause(0.3)


async def unsupported_model(pilot, t):
    await send(pilot, "Hello", t)


CALL = '<tool_call>\n{"name": "echo", "arguments": {"text": "hello from the tool"}}\n</tool_call>'
TOOL_REPLIES = [CALL, "The tool answered: echo: hello from the tool."]


async def tool_approval(pilot, t):
    from tierchat.tui.screens.tool_approval import ToolApprovalScreen
    from tierchat.tui.widgets.chat_input import ChatInput

    app = pilot.app
    deadline = time.monotonic() + t
    while not app.tools.ready.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    box = app.screen_stack[0].query_one(ChatInput)
    box.focus()
    box.insert("Say hello through the echo tool.")
    await pilot.press("enter")
    while not isinstance(app.screen, ToolApprovalScreen):
        if time.monotonic() > deadline:
            raise TimeoutError("no approval dialog")
        await asyncio.sleep(0.05)
        await pilot.pause()
    await pilot.pause(0.2)


async def tool_round(pilot, t):
    await tool_approval(pilot, t)
    await pilot.press("y")
    screen = pilot.app.screen_stack[0]
    deadline = time.monotonic() + t
    while [n.role for n in pilot.app.session.active_path()][-2:] != ["tool", "assistant"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the round did not finish")
        await asyncio.sleep(0.05)
        await pilot.pause()
    await settle(pilot, t)
    screen.pane.query_one("#transcript").scroll_end(animate=False)


def tool_setup(settings):
    """(engine, MCP host) of a tool round: the fake engine with ``tiny:qwen2``'s tokenizer
    and a recorded call; the MCP test server of tests/mcp_kit.py."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fakes import FakeEngine
    from mcp_kit import stdio_config
    from tierchat.core.models.tiny import load_tiny_tokenizer, materialize_tiny
    from tierchat.core.tools.mcp_host import McpHost

    tokenizer = load_tiny_tokenizer(materialize_tiny("qwen2", settings.models_dir))
    engine = FakeEngine("demo", tokenizer=tokenizer, replies=list(TOOL_REPLIES))
    return engine, McpHost([stdio_config()])


async def error_notification(pilot, t):
    await send(pilot, "Hello", t)
    pilot.app.clear_notifications()
    engine = pilot.app.engine
    if hasattr(engine, "fail_next"):  # the fake loads anything: make it fail like the real one
        engine.fail_next = "no MLX model at /no/such/model-dir (config.json missing)"
    pilot.app.screen_stack[0].action_load_model("/no/such/model-dir")


@dataclass(frozen=True)
class State:
    """``name`` of the file; ``steps`` to reach it; ``supported`` False uses the fake engine
    of an uncacheable model; ``modal`` states are shot as they are (no settle, toasts kept
    when ``toasts``)."""

    name: str
    steps: Steps
    supported: bool = True
    modal: bool = False
    toasts: bool = False
    tools: bool = False
    sizes: tuple[str, ...] = tuple(SIZES)


STATES: tuple[State, ...] = (
    State("empty", empty),
    State("three-way-swipe", three_way_swipe),
    State("panels-after-hits", panels_after_hits),
    State("panels-shown", panels_narrow, sizes=("-100x30",)),
    State("branches", branches),
    State("settings", settings_dialog, modal=True),
    State("clear-confirm", clear_confirm, modal=True),
    State("command-palette", command_palette, modal=True),
    State("unsupported-model", unsupported_model, supported=False),
    State("error-notification", error_notification, toasts=True),
    State("tool-approval", tool_approval, modal=True, tools=True),
    State("tool-round", tool_round, tools=True),
)


async def shoot(state: State, args, out: Path, suffix: str) -> Path:
    from tierchat.core.chat.store import ConversationStore
    from tierchat.tui.app import TierchatApp

    with tempfile.TemporaryDirectory(prefix="tierchat-shots-") as tmp:
        settings = make_settings(args.model, Path(tmp))
        host = None
        if state.tools:
            settings.sampling = replace(settings.sampling, max_tokens=256)  # a call in tiny tokens
            engine, host = tool_setup(settings)
        else:
            engine = make_engine(args, settings, supported=state.supported)
        store = ConversationStore(Path(tmp) / "chat.sqlite", clock=lambda: FIXED_EPOCH)
        app = TierchatApp(engine, store, settings, clock=lambda: 0.0, mcp_host=host)
        app.animation_level = "none"
        try:
            async with app.run_test(size=SIZES[suffix], notifications=True) as pilot:
                await settle(pilot, args.timeout)
                app.clear_notifications()
                await state.steps(pilot, args.timeout)
                if not state.modal:
                    await settle(pilot, args.timeout)
                    if not state.toasts:
                        app.clear_notifications()
                await pilot.pause(0.2)
                svg = app.export_screenshot(title=f"tierchat · {state.name}")
        finally:
            engine.close()
            store.close()
            if host is not None:
                host.close()
    path = out / f"{state.name}{suffix}.svg"
    path.write_text(svg, encoding="utf-8")
    return path


def to_png(svg: Path) -> Path | None:
    png = svg.with_suffix(".png")
    try:
        import cairosvg
    except ImportError:
        cairosvg = None
    if cairosvg is not None:
        cairosvg.svg2png(url=str(svg), write_to=str(png), output_width=1800)
        return png
    if shutil.which("rsvg-convert"):
        subprocess.run(["rsvg-convert", "-w", "1800", "-o", str(png), str(svg)], check=True)
        return png
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", action="store_true", help="use the test fake engine")
    parser.add_argument("--model", default="demo", help="model spec (default: demo)")
    parser.add_argument("--out", type=Path, default=ROOT / "screenshots")
    parser.add_argument("--only", nargs="*", help="state names to shoot")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per wait")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    converter = True
    for state in STATES:
        if args.only and state.name not in args.only:
            continue
        for suffix in state.sizes:
            svg = asyncio.run(shoot(state, args, args.out, suffix))
            png = to_png(svg) if converter else None
            converter = converter and png is not None
            print(svg, png.name if png else "")
    if not converter:
        print("no SVG -> PNG converter (pip install cairosvg, or apt install librsvg2-bin)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
