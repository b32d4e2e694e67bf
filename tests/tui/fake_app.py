"""Run the real TUI on the fake engine in a real terminal (for tests/tui/test_terminal_keys.py).

    python tests/tui/fake_app.py --data-dir D --cache-dir C --trace T.jsonl

The app, store (SQLite under ``--data-dir``), settings and key handling are the real
ones; only the engine is ``tests/fakes.FakeEngine`` (no MLX, instant replies). Every
action a key runs is appended to ``--trace`` as a JSON line ``{"action", "ok", "screen",
"focused"}``, every focus change as ``{"focus", "screen"}``, the chat screen's
``{"streaming": bool}`` and ``{"ready": true}`` once it is up, so a test that types bytes
into the pty can see which binding they reached (and wait until a dialog can take text).

``--tool-replies FILE`` (a JSON list of reply texts) runs tool rounds: the fake engine
speaks ``tiny:qwen2``'s tokenizer (``--models-dir``) and replies with those texts first, the
MCP test server of ``tests/mcp_kit.py`` gives the tools, and ``{"tools_ready": true}`` is
traced once it is up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for fakes

from fakes import FakeEngine  # noqa: E402
from tierchat.config.settings import Settings  # noqa: E402
from tierchat.core.chat.store import ConversationStore  # noqa: E402
from tierchat.core.sampling_params import SamplingParams  # noqa: E402
from tierchat.tui.app import TierchatApp  # noqa: E402


class TracingApp(TierchatApp):
    """The app, writing every action it runs (and whether it ran) to a trace file."""

    def __init__(self, *args, trace: Path, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trace = trace

    def _write(self, record: dict) -> None:
        with self.trace.open("a") as f:
            f.write(json.dumps(record) + "\n")

    async def run_action(self, action, default_namespace=None) -> bool:
        ok = await super().run_action(action, default_namespace)
        if isinstance(action, str):
            focused = self.focused
            self._write(
                {
                    "action": action,
                    "ok": bool(ok),
                    "screen": type(self.screen).__name__,
                    "focused": type(focused).__name__ if focused is not None else None,
                }
            )
        return ok

    def on_descendant_focus(self, event) -> None:
        self._write({"focus": type(event.widget).__name__, "screen": type(self.screen).__name__})

    def on_ready(self) -> None:
        def streaming(value: bool) -> None:
            self._write({"streaming": value})

        self.watch(self.screen, "streaming", streaming, init=False)
        self._write({"ready": True})
        if self.tools.enabled:

            async def tools_ready() -> None:
                await self.tools.ready.wait()
                self._write({"tools_ready": True})

            self.run_worker(tools_ready())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--reasoning", default=None, help="replies start with <think>…</think>")
    parser.add_argument("--tool-replies", type=Path, default=None, help="JSON list: tool rounds")
    parser.add_argument("--models-dir", type=Path, default=None)
    args = parser.parse_args()
    settings = Settings(
        sampling=SamplingParams(max_tokens=64),
        model="demo",
        data_dir=args.data_dir,
        cache_dir=args.cache_dir,
        models_dir=args.data_dir / "models",
    )
    host = None
    if args.tool_replies is not None:
        from mcp_kit import stdio_config
        from tierchat.core.models.tiny import load_tiny_tokenizer, materialize_tiny
        from tierchat.core.tools.mcp_host import McpHost

        tokenizer = load_tiny_tokenizer(materialize_tiny("qwen2", args.models_dir))
        replies = json.loads(args.tool_replies.read_text())
        engine = FakeEngine("demo", tokenizer=tokenizer, replies=replies, context_length=32768)
        # a call is ~60 tiny tokens
        settings.sampling = dataclasses.replace(settings.sampling, max_tokens=512)
        host = McpHost([stdio_config()])
    else:
        engine = FakeEngine("demo", token_delay_s=args.token_delay, reasoning=args.reasoning)
    store = ConversationStore(settings.db_path)
    try:
        TracingApp(engine, store, settings, trace=args.trace, mcp_host=host).run()
    finally:
        engine.close()
        store.close()


if __name__ == "__main__":
    main()
