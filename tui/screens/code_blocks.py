"""Pick one fenced code block of a message and copy it (the app's clipboard path,
``App.copy_to_clipboard``): a list of the blocks (core/chat/code_blocks.py), Enter or the
block's number copies it."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option
from tierchat.core.chat.code_blocks import CodeBlock

PREVIEW_LINES = 3


def block_label(block: CodeBlock) -> str:
    """``python · 12 lines`` (``cut off`` when the message ends inside the block)."""
    lines = block.code.count("\n") + 1 if block.code else 0
    parts = [block.language or "code", f"{lines} line{'s' if lines != 1 else ''}"]
    if not block.closed:
        parts.append("cut off")
    return " · ".join(parts)


def block_option(number: int, block: CodeBlock) -> Option:
    lines = block.code.splitlines() or [""]
    preview = lines[:PREVIEW_LINES] + (["…"] if len(lines) > PREVIEW_LINES else [])
    head = Content(f"{number} · {block_label(block)}").stylize("bold")
    body = Content("\n".join(preview)).stylize("$text-muted")
    return Option(Content("\n").join([head, body]))


class CodeBlocksScreen(ModalScreen[CodeBlock | None]):
    """Dismisses with the chosen block (the caller copies it) or None (Esc)."""

    CSS_PATH = "code_blocks.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="code_cancel"),
        *[
            Binding(str(n), f"pick({n - 1})", f"Block {n}", id=f"code_{n}", show=False)
            for n in range(1, 10)
        ],
    ]

    def __init__(self, blocks: list[CodeBlock], title: str) -> None:
        super().__init__()
        self.blocks = blocks
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog") as dialog:
            dialog.border_title = self.title_text
            yield OptionList(
                *[block_option(i + 1, b) for i, b in enumerate(self.blocks)], id="code-list"
            )
            yield Static("↑↓ pick · Enter or 1–9 copy · Esc cancel", classes="hint")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        options.highlighted = 0
        options.focus()

    @on(OptionList.OptionSelected, "#code-list")
    def _selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.action_pick(event.option_index)

    def action_pick(self, index: int) -> None:
        if 0 <= index < len(self.blocks):
            self.dismiss(self.blocks[index])

    def action_cancel(self) -> None:
        self.dismiss(None)
