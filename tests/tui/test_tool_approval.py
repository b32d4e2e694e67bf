"""tui/screens/tool_approval.py: the approval before a tool call runs answers with what the
user chose, by key and by button, and a reason typed for a denial reaches the result."""

from __future__ import annotations

import pytest
from textual.app import App
from tierchat.tui.screens.tool_approval import Approval, ToolApprovalScreen, arguments_text

pytestmark = pytest.mark.anyio


class Host(App):
    def __init__(self, arguments: object = '{"path": "/tmp/a.txt"}') -> None:
        super().__init__()
        self.arguments = arguments
        self.answers: list[Approval] = []

    def on_mount(self) -> None:
        screen = ToolApprovalScreen("files", "read_file", self.arguments, round_no=2)
        self.push_screen(screen, self.answers.append)


async def choose(*keys: str, arguments: object = '{"path": "/tmp/a.txt"}') -> list[Approval]:
    app = Host(arguments)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press(*keys)
        await pilot.pause()
        return app.answers


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (("y",), Approval("once")),
        (("a",), Approval("always")),
        (("escape",), Approval("deny")),
        (("n", "n", "o", "p", "e", "enter"), Approval("deny", "nope")),
        # y, a and n typed into the reason are letters, not choices
        (("n", "y", "a", "n", "enter"), Approval("deny", "yan")),
    ],
)
async def test_keys_choose(keys, expected):
    assert await choose(*keys) == [expected]


async def test_buttons_choose():
    app = Host()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.click("#always")
        await pilot.pause()
    assert app.answers == [Approval("always")]
    assert Approval("always").allowed and not Approval("deny", "x").allowed


async def test_the_dialog_names_the_call():
    app = Host('{"path": "/etc/hosts"}')
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        text = " ".join(str(w.render()) for w in app.screen.query("Static"))
        assert "read_file" in text and "files" in text and "/etc/hosts" in text


def test_arguments_text():
    assert arguments_text('{"a": 1}') == '{\n  "a": 1\n}'
    assert arguments_text("not json") == "not json"
    assert arguments_text({"b": "é"}) == '{\n  "b": "é"\n}'
    cut = arguments_text("x" * 50, limit=10)
    assert cut.startswith("x" * 10) and "40 more characters" in cut
