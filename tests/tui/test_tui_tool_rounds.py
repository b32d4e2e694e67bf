"""Tool rounds in the TUI (tui/screens/chat/tool_rounds.py, docs/DESIGN.md §12.1, §16): a
fake engine speaking ``tiny:qwen2``'s tokenizer replies with recorded calls, the tools run
on the real MCP test server (tests/mcp_kit.py, stdio). Approve once, deny with a reason,
allow for the chat, Esc cancels a slow call, an unknown tool and a failing tool are error
results and the conversation goes on; the Events log names each round; ``/tools`` and F9
enable and disable servers."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from textual.clock import MockClock
from textual.widgets import Input, TextArea

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the kits

from fakes import FakeEngine
from mcp_kit import stdio_config
from tierchat.core.models.tiny import load_tiny_tokenizer, materialize_tiny
from tierchat.core.tools.mcp_host import McpHost
from tierchat.tui.screens.conversation_settings import ConversationSettingsScreen
from tierchat.tui.screens.raw_message import RawMessageScreen
from tierchat.tui.screens.tool_approval import ToolApprovalScreen
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.tool_block import ToolCallBlock, ToolResultBlock
from tui_kit import SIZE, chat_screen, settle, wait_for

pytestmark = pytest.mark.anyio


def call_text(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


class NotingEngine(FakeEngine):
    """The fake engine with ``Engine.note`` (the cache events the Events log shows)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


@pytest.fixture(scope="module")
def qwen_tokenizer(models_dir):
    return load_tiny_tokenizer(materialize_tiny("qwen2", models_dir))


@pytest.fixture
def tools_app(qwen_tokenizer, store, settings):
    """``make(replies)`` -> (app, engine) on the kit server; hosts closed at the end."""
    from tierchat.tui.app import TierchatApp

    made = []
    # a call takes ~60 tiny tokens
    settings = dataclasses.replace(
        settings, sampling=dataclasses.replace(settings.sampling, max_tokens=512)
    )

    def make(replies: list[str], **overrides):
        engine = NotingEngine(
            "demo", tokenizer=qwen_tokenizer, replies=list(replies), context_length=32768
        )
        host = McpHost([stdio_config()])
        app = TierchatApp(
            engine,
            store,
            dataclasses.replace(settings, **overrides),
            clock=MockClock(0.0),
            mcp_host=host,
        )
        app.animation_level = "none"
        made.append((engine, host))
        return app, engine

    yield make
    for engine, host in made:
        host.close()
        engine.close()


def path(app) -> list[tuple[str, str]]:
    return [(n.role, n.content) for n in app.session.active_path()]


def tool_metas(app) -> list[dict]:
    return [n.meta for n in app.session.active_path() if n.role == "tool"]


async def ready(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.tools.ready.is_set(), what="the MCP server")
    await settle(pilot)


async def send(pilot, text: str) -> None:
    box = chat_screen(pilot.app).query_one(ChatInput)
    box.focus()
    box.load_text(text)
    await pilot.press("enter")


async def approval(pilot) -> ToolApprovalScreen:
    await wait_for(
        pilot, lambda: isinstance(pilot.app.screen, ToolApprovalScreen), what="the approval"
    )
    await pilot.pause()
    return pilot.app.screen


async def roles_become(pilot, roles: list[str]) -> None:
    app = pilot.app
    await wait_for(
        pilot,
        lambda: [r for r, _ in path(app)] == roles and not chat_screen(app).streaming,
        what=f"the path {roles}",
    )
    await settle(pilot)


async def one_approved_round(pilot, text: str) -> None:
    """Send ``text``, approve the call once, wait for the step after its result."""
    await ready(pilot)
    await send(pilot, text)
    await approval(pilot)
    await pilot.press("y")
    await roles_become(pilot, ["user", "assistant", "tool", "assistant"])


async def test_approve_once_runs_the_call_and_the_next_step(tools_app):
    app, engine = tools_app([call_text("echo", '{"text": "hi"}'), "It said: echo: hi."])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Say hi through echo.")
        dialog = await approval(pilot)
        assert (dialog.server, dialog.tool) == ("kit", "echo")
        await pilot.press("y")
        await roles_become(pilot, ["user", "assistant", "tool", "assistant"])
        assert path(app)[2] == ("tool", "echo: hi")
        assert path(app)[3] == ("assistant", "It said: echo: hi.")
        pane = chat_screen(app).pane
        (block,) = pane.query(ToolCallBlock)
        assert (block.server, block.tool) == ("kit", "echo")
        (result,) = pane.query(ToolResultBlock)
        assert result.state == "ok" and result.text == "echo: hi"
        assert [n for n in engine.notes if n.startswith("round 1 · kit.echo")]
        # the next step's prompt is the first one + the reply + the result
        first, second = engine.requests
        assert list(second.prompt_ids[: len(first.prompt_ids)]) == list(first.prompt_ids)
        # not allowed for the chat: "once" asks again next time
        assert app.session.settings().allowed_tools == ()
        # v on the result shows the whole result
        await pilot.press("escape", "up")  # the message cursor: the result
        assert pane.target().info.role == "tool"
        await pilot.press("v")
        await wait_for(pilot, lambda: isinstance(app.screen, RawMessageScreen))
        assert app.screen.query_one(TextArea).text == "echo: hi"


async def test_deny_with_a_reason_goes_to_the_model(tools_app):
    app, engine = tools_app([call_text("echo", '{"text": "hi"}'), "Fine, I won't."])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Say hi through echo.")
        await approval(pilot)
        await pilot.press("n")
        await pilot.press(*"not now")
        await pilot.press("enter")
        await roles_become(pilot, ["user", "assistant", "tool", "assistant"])
        (meta,) = tool_metas(app)
        assert meta["denied"] and meta["is_error"]
        assert path(app)[2] == ("tool", "the user denied this call: not now")
        (result,) = chat_screen(app).pane.query(ToolResultBlock)
        assert result.state == "denied"
        assert "not now" in engine._tokenizer.decode(list(engine.requests[1].prompt_ids))


async def test_allow_for_the_chat_asks_once(tools_app):
    calls = [call_text("echo", '{"text": "one"}'), call_text("echo", '{"text": "two"}')]
    app, engine = tools_app([*calls, "Both done."])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Echo twice.")
        await approval(pilot)
        await pilot.press("a")
        roles = ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        await roles_become(pilot, roles)  # the second call ran without asking
        assert [c for r, c in path(app) if r == "tool"] == ["echo: one", "echo: two"]
        assert app.session.settings().allowed_tools == ("kit.echo",)
        assert [n for n in engine.notes if n.startswith("round 2 · kit.echo")]


async def test_esc_cancels_a_slow_call(tools_app):
    app, engine = tools_app([call_text("slow", '{"seconds": 60}'), "never asked for"])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Take your time.")
        await approval(pilot)
        await pilot.press("y")
        pane = chat_screen(app).pane
        await wait_for(
            pilot,
            lambda: any(b.state == "running" for b in pane.query(ToolResultBlock)),
            what="the running block",
        )
        assert chat_screen(app).streaming  # Esc is live
        await pilot.press("escape")
        await roles_become(pilot, ["user", "assistant", "tool"])
        (meta,) = tool_metas(app)
        assert meta["cancelled"]
        (result,) = pane.query(ToolResultBlock)
        assert result.state == "cancelled"
        assert len(engine.requests) == 1  # no next step after a stop
        # the conversation goes on
        await send(pilot, "Never mind.")
        await roles_become(pilot, ["user", "assistant", "tool", "user", "assistant"])


async def test_unknown_tool_and_failing_tool_are_error_results(tools_app):
    reply = call_text("nope", "{}") + "\n" + call_text("fail", '{"reason": "disk on fire"}')
    app, _engine = tools_app([reply, "Both failed."])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Try these.")
        await approval(pilot)  # only the call that can run is asked about
        await pilot.press("y")
        await roles_become(pilot, ["user", "assistant", "tool", "tool", "assistant"])
        unknown, failed = tool_metas(app)
        assert unknown["is_error"] and unknown["server"] is None
        assert failed["is_error"] and failed["server"] == "kit"
        contents = [c for r, c in path(app) if r == "tool"]
        assert "no tool named 'nope'" in contents[0] and "fail" in contents[1]
        states = [b.state for b in chat_screen(app).pane.query(ToolResultBlock)]
        assert states == ["error", "error"]
        assert path(app)[-1] == ("assistant", "Both failed.")


async def test_tools_command_and_settings_field(tools_app):
    app, _engine = tools_app(["plain answer"])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        await settle(pilot)
        assert app.session.settings().tools == ("kit",)
        await send(pilot, "/tools off kit")
        await settle(pilot)
        assert app.session.settings().tools == ()
        assert chat_screen(app).query_one(ChatInput).text == ""
        await pilot.press("f9")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationSettingsScreen))
        field = app.screen.query_one("#tools", Input)
        assert field.value == ""
        field.value = "kit"
        await pilot.press("ctrl+s")
        await settle(pilot)
        assert app.session.settings().tools == ("kit",)


async def test_a_crash_a_timeout_and_bad_json_are_error_results(tools_app, settings):
    reply = "\n".join(
        [call_text("hang", "{}"), call_text("echo", '{"text": '), call_text("crash", "{}")]
    )
    app, _engine = tools_app([reply, "All three failed."], tool_timeout_s=1.0)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Break things.")
        for _ in range(2):  # hang, crash (the unreadable call is not asked about)
            await approval(pilot)
            await pilot.press("y")
        await roles_become(pilot, ["user", "assistant", "tool", "tool", "tool", "assistant"])
        hang, crash, bad = tool_metas(app)  # an unreadable call is answered last
        assert hang["timed_out"] and hang["is_error"]
        assert bad["is_error"] and bad["server"] is None
        assert crash["is_error"] and crash["server"] == "kit"
        assert "not valid JSON" in path(app)[4][1] or "could not be read" in path(app)[4][1]
        states = [b.state for b in chat_screen(app).pane.query(ToolResultBlock)]
        assert states == ["error", "error", "error"]
        assert path(app)[-1] == ("assistant", "All three failed.")


async def test_regenerate_the_step_after_a_result_keeps_the_round(tools_app):
    app, engine = tools_app([call_text("echo", '{"text": "hi"}'), "First answer.", "Second."])
    async with app.run_test(size=SIZE) as pilot:
        await one_approved_round(pilot, "Say hi through echo.")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: path(app)[-1] == ("assistant", "Second."))
        await settle(pilot)
        assert [r for r, _ in path(app)] == ["user", "assistant", "tool", "assistant"]
        # the same prompt as the step it replaces: the path to the result
        assert engine.requests[2].prompt_ids == engine.requests[1].prompt_ids


async def test_a_server_that_fails_to_start_is_said(qwen_tokenizer, store, settings):
    from tierchat.core.tools.config import ServerConfig
    from tierchat.tui.app import TierchatApp

    engine = NotingEngine("demo", tokenizer=qwen_tokenizer)
    broken = ServerConfig(
        "broken", "stdio", command=sys.executable, args=("-c", "import sys; sys.exit('no way')")
    )
    host = McpHost([broken])
    app = TierchatApp(engine, store, settings, clock=MockClock(0.0), mcp_host=host)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            errors = [n for n in app._notifications if n.severity == "error"]
            assert any("broken" in n.message for n in errors), errors
            assert any("MCP server broken failed" in n for n in engine.notes)
    finally:
        host.close()
        engine.close()


async def test_the_round_limit_answers_not_run_and_stops(tools_app):
    calls = [call_text("echo", '{"text": "one"}'), call_text("echo", '{"text": "two"}')]
    app, engine = tools_app([*calls, "never asked for"], tool_rounds=1)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Echo twice.")
        await approval(pilot)
        await pilot.press("a")
        await roles_become(pilot, ["user", "assistant", "tool", "assistant", "tool"])
        first, second = [c for r, c in path(app) if r == "tool"]
        assert first == "echo: one" and "limit of 1 tool rounds" in second
        assert len(engine.requests) == 2  # no step after the limit
        assert any("limit of 1 tool rounds" in n.message for n in app._notifications)


async def test_the_streaming_reply_holds_its_call_markup_back(tools_app, monkeypatch):
    from tierchat.tui.widgets.transcript import MessageView

    streamed: list[str] = []
    stream_to = MessageView.stream_to

    async def recording(self, text: str):
        streamed.append(text)
        return await stream_to(self, text)

    monkeypatch.setattr(MessageView, "stream_to", recording)
    reply = "Let me look that up.\n" + call_text("echo", '{"text": "hi"}')
    app, engine = tools_app([reply, "It said hi."])
    engine.batch_size = 2  # many deltas: the markup arrives over several of them
    async with app.run_test(size=SIZE) as pilot:
        await one_approved_round(pilot, "Say hi through echo.")
    assert any("Let me look that up." in t for t in streamed), streamed
    # what the placeholder showed never had the call's markup or its JSON
    assert not [t for t in streamed if "<tool" in t or '"name"' in t or "{" in t], streamed
    assert any(t.endswith("It said hi.") for t in streamed)
