"""Run the real TUI on the fake engine in a real terminal (for tests/tui/test_terminal_keys.py).

    python tests/tui/fake_app.py --data-dir D --cache-dir C --trace T.jsonl

The app, store (SQLite under ``--data-dir``), settings and key handling are the real
ones; only the engine is ``tests/fakes.FakeEngine`` (no MLX, instant replies). Every
action a key runs is appended to ``--trace`` as a JSON line ``{"action", "ok", "screen",
"focused"}``, every focus change as ``{"focus", "screen"}``, the chat screen's
``{"streaming": bool}`` and ``{"ready": true}`` once it is up, so a test that types bytes
into the pty can see which binding they reached (and wait until a dialog can take text).
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--reasoning", default=None, help="replies start with <think>…</think>")
    args = parser.parse_args()
    settings = Settings(
        sampling=SamplingParams(max_tokens=64),
        model="demo",
        data_dir=args.data_dir,
        cache_dir=args.cache_dir,
        models_dir=args.data_dir / "models",
    )
    engine = FakeEngine("demo", token_delay_s=args.token_delay, reasoning=args.reasoning)
    store = ConversationStore(settings.db_path)
    try:
        TracingApp(engine, store, settings, trace=args.trace).run()
    finally:
        engine.close()
        store.close()


if __name__ == "__main__":
    main()
