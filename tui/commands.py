"""Command palette providers: every action of the chat screen and of its message pane,
plus one command per conversation and per built-in model. A command runs the same action
as its key binding, on the same widget, and is left out while that widget's
``check_action`` says the action cannot run now."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from textual.actions import parse
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.dom import DOMNode

if TYPE_CHECKING:
    from tierchat.tui.app import TierchatApp


PANE = "#chat"
"""The message pane of the chat screen (``screens/chat/pane.py``): the owner of the
actions on messages, the replies and the input."""


@dataclass(frozen=True)
class Command:
    """``title`` as the palette shows it, the ``action`` it runs, ``help``, and ``owner``:
    the selector of the widget on the screen whose action it is ("": the screen's)."""

    title: str
    action: str
    help: str
    owner: str = ""


CACHE_COMMANDS: tuple[Command, ...] = (
    Command("Cache: clear hot tier", "clear('hot')", "Drop every block held in RAM"),
    Command("Cache: clear SSD tier", "clear('ssd')", "Delete every block file on disk"),
    Command("Cache: clear tails", "clear('tails')", "Drop MRU tails and checkpoints"),
    Command("Cache: clear all", "clear('all')", "Drop every tier: the next turn is cold"),
    Command("Cache: toggle panels", "toggle_panels", "Show or hide the live cache panels"),
)

BRANCH_COMMANDS: tuple[Command, ...] = (
    Command("Branch: regenerate reply", "regenerate", "A new sibling reply; old ones stay", PANE),
    Command("Branch: continue reply", "continue_reply", "More of a reply cut at max tokens", PANE),
    Command("Branch: previous", "swipe(-1)", "The previous sibling of the selected message", PANE),
    Command("Branch: next", "swipe(1)", "The next sibling of the selected message", PANE),
    Command("Branch: edit message", "edit", "Edit the selected user message as a new branch", PANE),
    Command("Branch: fork conversation", "fork", "Copy the path up to here into a new chat", PANE),
    Command("Chat: copy message", "copy", "Copy the selected message to the clipboard", PANE),
    Command(
        "Chat: show or hide reasoning", "toggle_reasoning", "The <think> part of a reply", PANE
    ),
    Command("Chat: message cursor", "select(-1)", "Move the focus onto the messages", PANE),
    Command("Chat: stop generation", "stop", "Stop decoding now"),
)

CONVERSATION_COMMANDS: tuple[Command, ...] = (
    Command("Conversation: new", "new_conversation", "Start an empty conversation"),
    Command("Conversation: rename", "rename_conversation", "Rename the open conversation"),
    Command("Conversation: delete", "delete_conversation", "Delete the open conversation"),
    Command("Conversation: toggle list", "toggle_conversations", "Show or hide the list"),
    Command(
        "Conversation: settings (system prompt, sampling)…",
        "conversation_settings",
        "System prompt, temperature, top-p/k, min-p, penalty, stop, max tokens, seed",
    ),
    Command("Export: active path as Markdown", "export('md', 'path')", "Under the data dir", PANE),
    Command("Export: active path as JSON", "export('json', 'path')", "Under the data dir", PANE),
    Command(
        "Export: whole tree as Markdown", "export('md', 'tree')", "Every branch, outlined", PANE
    ),
    Command("Export: whole tree as JSON", "export('json', 'tree')", "Every branch, nested", PANE),
    Command("Help: keys", "app.help", "Every key binding and its id"),
)


TOOL_COMMANDS: tuple[Command, ...] = (
    Command("Search: this conversation…", "search('here')", "Find messages by their words", PANE),
    Command("Search: all conversations…", "search('all')", "Open a chat at an old message", PANE),
    Command("Chat: raw text of message", "raw_message", "The selected message as stored", PANE),
    Command(
        "Chat: verify reply against cold",
        "verify_turn",
        "Recompute the selected reply without the cache: top-1, first diff, max |Δlogprob|",
        PANE,
    ),
    Command(
        "Chat: copy a code block", "copy_code", "One fenced block of the selected message", PANE
    ),
    Command("Chat: delete message", "delete_message", "Only the selected message", PANE),
    Command("Chat: delete branch", "delete_branch", "The selected message and all after it", PANE),
    Command("Chat: undo delete", "undo_delete", "Bring back the last deleted chat or messages"),
    Command("Input: open in $EDITOR", "edit_in_editor", "Write a long prompt in your editor", PANE),
    Command("Input: clear", "clear_input", "Empty the input (Ctrl+Z undoes)", PANE),
    Command("Conversation: import from JSON…", "import_conversation", "A file Export wrote", PANE),
)

FOUND_MIN_CHARS = 3
"""Palette text shorter than this searches no messages."""


class ActionProvider(Provider):
    """Offers :attr:`COMMANDS`; runs each as an action of its owner on the screen the
    palette opened on."""

    COMMANDS: tuple[Command, ...] = ()

    def commands(self) -> Iterator[Command]:
        yield from self.COMMANDS

    def _owner(self, command: Command) -> DOMNode:
        return self.screen.query_one(command.owner) if command.owner else self.screen

    def _available(self, command: Command) -> bool:
        name, params = _split(command.action)
        return self._owner(command).check_action(name, params) is True

    async def _run(self, command: Command) -> None:
        await self.app.run_action(command.action, self._owner(command))

    async def discover(self) -> Hits:
        for command in self.commands():
            if self._available(command):
                yield DiscoveryHit(command.title, partial(self._run, command), help=command.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for command in self.commands():
            score = matcher.match(command.title)
            if score > 0 and self._available(command):
                yield Hit(
                    score,
                    matcher.highlight(command.title),
                    partial(self._run, command),
                    help=command.help,
                )


def _split(action: str) -> tuple[str, tuple[object, ...]]:
    """``"clear('hot')"`` -> ``("clear", ("hot",))``."""
    _namespace, name, params = parse(action)
    return name, params


class CacheCommands(ActionProvider):
    COMMANDS = CACHE_COMMANDS


class BranchCommands(ActionProvider):
    COMMANDS = BRANCH_COMMANDS


class ConversationCommands(ActionProvider):
    """The conversation actions plus "Open: <title>" for every stored conversation."""

    COMMANDS = CONVERSATION_COMMANDS

    def commands(self) -> Iterator[Command]:
        yield from self.COMMANDS
        app: TierchatApp = self.app  # type: ignore[assignment]
        for info in app.store.list_conversations():
            title = info.title or f"conversation {info.id}"
            yield Command(f"Open: {title}", f"open_conversation({info.id})", "Open this chat")


class ToolCommands(ActionProvider):
    COMMANDS = TOOL_COMMANDS


class FoundMessages(Provider):
    """Messages holding the palette's words (``ConversationStore.search``, every
    conversation): "Found in <title>: <snippet>" opens that conversation at the message."""

    async def search(self, query: str) -> Hits:
        from textual.content import Content

        if (
            len(query.strip()) < FOUND_MIN_CHARS
            or self.screen.query_one(PANE).check_action("open_found", ()) is not True
        ):
            return
        app: TierchatApp = self.app  # type: ignore[assignment]
        try:
            hits = app.store.search(query, limit=8)
        except Exception:  # noqa: BLE001 - the palette lists commands without them
            return
        for rank, hit in enumerate(hits):
            text = Content(f"Found in {hit.title}: ")
            snippet = Content(hit.snippet)
            for start, end in hit.marks:
                snippet = snippet.stylize("bold", start, end)
            yield Hit(
                0.5 - rank / 100,
                text + snippet,
                partial(self._open, hit.node_id),
                text=f"Found in {hit.title}: {hit.snippet}",
                help=f"{hit.role} message · opens the conversation there",
            )

    async def _open(self, node_id: int) -> None:
        await self.app.run_action(f"open_found({node_id})", self.screen.query_one(PANE))


class ModelCommands(ActionProvider):
    """ "Model: pick…" plus "Model: load <name>" for every built-in model."""

    def commands(self) -> Iterator[Command]:
        from tierchat.tui.models import BUILTIN_MODELS

        yield Command("Model: pick…", "pick_model", "Choose a model to load on the engine")
        for spec, note in BUILTIN_MODELS:
            if spec.startswith("tiny:"):
                continue  # random-weight test models: typed in the picker, not offered
            yield Command(f"Model: load {spec}", f"load_model({spec!r})", note)
