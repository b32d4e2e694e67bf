"""What a daily user of the chat reaches for beyond chatting: search, a message's raw
text, verify, one code block copied, long prompts ($EDITOR, clear), deleting a message
or a branch, importing an export, fork, copy, reasoning shown or folded, export.

:class:`MessageTools` holds these actions of the message pane (``screens/chat/pane.py``
``MessagePane``, which owns the cursor they read: the message under it, or the last one).
Store reads go through ``TierchatApp.attempt`` and store writes through
``in_background`` (off the UI loop, in order), so an error is a notification, never a
crash. The screens it opens are in ``screens/search.py``, ``screens/raw_message.py``,
``screens/code_blocks.py``; the store work is in core (``ConversationStore.search``/
``delete_message``/``import_conversation``, ``core/chat/importer.py``,
``core/chat/code_blocks.py``, ``core/chat/editor.py``, ``core/chat/verify.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from textual.app import SuspendNotSupported
from textual.binding import Binding, BindingType
from tierchat.core.chat.code_blocks import CodeBlock, fenced_blocks
from tierchat.core.chat.editor import EditorError, edit_text
from tierchat.core.chat.importer import read_export
from tierchat.core.chat.verify import VerifyCancelled, VerifyReport, verify_reply
from tierchat.tui.messages import VerifyAdvanced, VerifyEnded
from tierchat.tui.screens.code_blocks import CodeBlocksScreen, block_label
from tierchat.tui.screens.confirm import ConfirmScreen
from tierchat.tui.screens.prompt import PromptScreen
from tierchat.tui.screens.raw_message import RawMessageScreen
from tierchat.tui.screens.search import SearchScreen
from tierchat.tui.widgets.activity import ActivityBar
from tierchat.tui.widgets.chat_input import ChatInput
from tierchat.tui.widgets.transcript import MessageView, Transcript

if TYPE_CHECKING:
    from tierchat.tui.app import TierchatApp

_T = TypeVar("_T")

ROLE_NAMES = {"user": "your", "assistant": "the assistant's", "system": "the system"}


MESSAGE_TOOL_BINDINGS: list[BindingType] = [
    Binding("ctrl+f", "search('here')", "Search", id="search", show=False),
    Binding("ctrl+g", "edit_in_editor", "$EDITOR", id="edit_in_editor", show=False),
    Binding("ctrl+l", "clear_input", "Clear input", id="clear_input", show=False),
    Binding("ctrl+o", "import_conversation", "Import", id="import_conversation", show=False),
]
"""The tools' keys (ids for the keymap), bound on the message pane: live from the input
and the transcript. The message-cursor keys for them (v, V, y, d, D) are in
``pane.py``."""


class MessageTools:
    """Search, raw view, verify, code-block copy, editor, clear input, delete, import,
    fork, copy, reasoning, export: actions of :class:`~tierchat.tui.screens.chat.pane.
    MessagePane`, on the message under its cursor (``target()``) or its input."""

    if TYPE_CHECKING:  # what the pane gives these actions
        tierchat: TierchatApp
        host: Any
        selected: int | None

        @property
        def streaming(self) -> bool: ...
        @property
        def conversation_id(self) -> int | None: ...
        def target(self) -> MessageView | None: ...
        def views(self) -> list[MessageView]: ...
        def focus_input(self) -> None: ...
        def sync_transcript(self) -> Any: ...
        async def synced(self) -> None: ...
        async def resync(self, selected: int | None) -> None: ...
        def in_background(self, title: str, call: Callable[[], Any]) -> Any: ...
        def notify(self, message: str, **kwargs: Any) -> None: ...

    # ------------------------------------------------------------------ availability

    def _message_target(self) -> MessageView | None:
        """The stored message under the cursor (or the last one), None for none or the
        system prompt shown from the settings (node id 0)."""
        target = self.target()
        if target is None or not target.info.node_id:
            return None
        return target

    def tool_state(self, action: str) -> bool | None:
        """As ``check_action`` for the tools' actions; ``NotImplemented`` for any other."""
        streaming = self.streaming
        if action == "raw_message":
            return True if self._message_target() is not None else None
        if action == "verify_turn":
            target = self._message_target()
            ok = not streaming and target is not None and target.info.role == "assistant"
            return True if ok else None
        if action == "copy_code":
            target = self._message_target()
            return True if target is not None and fenced_blocks(target.text) else None
        if action in ("delete_message", "delete_branch"):
            ok = not streaming and self._message_target() is not None
            return True if ok else None
        if action in ("open_found", "import_conversation"):
            return None if streaming else True
        if action == "clear_input":
            return True if self.query_one(ChatInput).text else None  # type: ignore[attr-defined]
        return NotImplemented  # type: ignore[return-value]  # not one of the tools' actions

    # ------------------------------------------------------------------ search

    def action_search(self, scope: str = "here") -> None:
        """Open the search dialog (``scope`` "here": the open conversation, "all")."""
        screen = SearchScreen(
            self.tierchat.store, self.conversation_id, "all" if scope == "all" else "here"
        )

        async def done(node_id: int | None) -> None:
            if node_id is not None:
                await self.action_open_found(node_id)

        self.tierchat.push_screen(screen, done)

    async def action_open_found(self, node_id: int) -> bool:
        """Open the conversation holding message ``node_id`` at that message: its branch
        becomes the active path where it was not, the transcript shows it (older messages
        mounted as needed) and the message cursor sits on it. False (with a notification)
        while a reply streams or when the store fails."""
        if self.streaming:
            self.notify("A reply is streaming; Esc stops it, then open the message.")
            return False
        store = self.tierchat.store

        def select() -> tuple[int, bool]:
            node = store.get_node(node_id)
            on_path = any(n.id == node_id for n in store.active_path(node.conversation_id))
            if not on_path:
                store.select_path(node_id)
            return node.conversation_id, not on_path

        ok, found = await self.in_background("Cannot open that message", select)
        if not ok or found is None:
            return False
        cid, switched = found
        self.host.open_conversation(cid)
        await self.synced()
        transcript = self.query_one(Transcript)  # type: ignore[attr-defined]
        ids = [v.info.node_id for v in transcript.views]
        while node_id not in ids and transcript.hidden:
            await transcript.show_earlier()
            ids = [v.info.node_id for v in transcript.views]
        transcript.focus()
        if node_id in ids:
            self.selected = ids.index(node_id)
        self.refresh_bindings()  # type: ignore[attr-defined]
        if switched:
            self.notify("The message is on another branch: that branch is shown now.")
        return True

    # ------------------------------------------------------------------ one message

    def _ask_about_target(
        self, failed: str, ask: Callable[[Any, int], _T]
    ) -> tuple[MessageView, _T] | None:
        """The message under the cursor and ``ask(store, node_id)`` for it, through
        ``attempt`` (``failed`` titles its error notification); None when there is no
        message there, or the store failed or answered None."""
        target = self._message_target()
        if target is None:
            return None
        store, node_id = self.tierchat.store, target.info.node_id
        ok, answer = self.tierchat.attempt(failed, lambda: ask(store, node_id))
        if not ok or answer is None:
            return None
        return target, answer

    def action_raw_message(self) -> None:
        asked = self._ask_about_target("Cannot read the message", lambda s, i: s.get_node(i))
        if asked is None:
            return
        _target, node = asked
        title = f"Raw text · {ROLE_NAMES.get(node.role, node.role)} message"
        self.tierchat.push_screen(RawMessageScreen(node.content, title))

    # ------------------------------------------------------------------ verify

    verify_cancel: threading.Event | None = None
    """Set to stop the verify that runs (None: none runs); one at a time."""

    @property
    def verifying(self) -> bool:
        """A verify against cold runs (Esc stops it)."""
        return self.verify_cancel is not None

    def action_verify_turn(self) -> None:
        """Verify the selected reply against cold (core/chat/verify.py) on a thread: its
        progress in the activity bar, Esc stops it; the report goes to the reply's row
        (stored with it), a notification and the events. One verify at a time."""
        if self.verifying:
            self.notify("A verify is running; Esc stops it.", title="Verify", severity="warning")
            return
        target = self._message_target()
        if target is None or target.info.role != "assistant" or not target.info.node_id:
            self.notify("Select a reply to verify", severity="warning")
            return
        self.notify("Recomputing the reply with no cache, twice…", title="Verify against cold")
        node_id, cancel = target.info.node_id, threading.Event()
        self.verify_cancel = cancel
        self.refresh_bindings()  # type: ignore[attr-defined]  # Esc: stop
        self.run_worker(  # type: ignore[attr-defined]
            lambda: self._verify(node_id, cancel), thread=True, group="verify"
        )

    def stop_verify(self) -> bool:
        """Stop the verify that runs at its next engine step; False when none runs."""
        if self.verify_cancel is None or self.verify_cancel.is_set():
            return self.verify_cancel is not None
        self.verify_cancel.set()
        if not self.streaming:
            self.query_one(ActivityBar).show_stopping(" verify")  # type: ignore[attr-defined]
        return True

    def _verify(self, node_id: int, cancel: threading.Event) -> None:
        """On a worker thread: the verify runs the engine three times and waits for it;
        its progress and end are posted as messages (no widget is touched here)."""
        post = self.post_message  # type: ignore[attr-defined]

        def progress(done: int, total: int) -> None:
            post(VerifyAdvanced(done, total))

        try:
            report = verify_reply(
                self.tierchat.session, node_id, on_progress=progress, cancel=cancel
            )
        except VerifyCancelled:
            post(VerifyEnded(stopped=True))
        except Exception as e:  # noqa: BLE001 - reported on the UI thread
            post(VerifyEnded(error=str(e) or type(e).__name__))
        else:
            post(VerifyEnded(report=report))

    def on_verify_advanced(self, event: VerifyAdvanced) -> None:
        """The activity bar shows the verify's progress (unless a reply of the
        conversation shown uses it, or the verify is stopping)."""
        cancel = self.verify_cancel
        if cancel is None or cancel.is_set() or self.streaming:
            return
        self.query_one(ActivityBar).show_verify(event.done, event.total)  # type: ignore[attr-defined]

    def on_verify_ended(self, event: VerifyEnded) -> None:
        self.verify_cancel = None
        if not self.streaming:
            self.query_one(ActivityBar).hide()  # type: ignore[attr-defined]
        self.refresh_bindings()  # type: ignore[attr-defined]
        if event.stopped:
            self.notify("Verify stopped; nothing was stored.", title="Verify stopped", timeout=4)
        elif event.error:
            self.notify(event.error, title="Verify failed", severity="error")
        elif isinstance(event.report, VerifyReport):
            self.notify(event.report.describe(), title="Verify against cold")
            self.sync_transcript()
            self.tierchat.poll_stats()

    def action_copy_code(self) -> None:
        """Copy one fenced code block of the message under the cursor: at once when it
        has one, else from a list."""
        target = self._message_target()
        if target is None:
            return
        blocks = fenced_blocks(target.text)
        if not blocks:
            self.notify("This message has no fenced code block.", timeout=3)
            return
        if len(blocks) == 1:
            self.copy_block(blocks[0])
            return

        def done(block: CodeBlock | None) -> None:
            if block is not None:
                self.copy_block(block)

        title = f"Copy a code block ({len(blocks)} in this message)"
        self.tierchat.push_screen(CodeBlocksScreen(blocks, title), done)

    def copy_block(self, block: CodeBlock) -> None:
        self.tierchat.copy_to_clipboard(block.code)
        self.notify(f"Copied the code block ({block_label(block)}).", timeout=3)

    def action_delete_message(self) -> None:
        """Delete the message under the cursor; what follows it moves up (confirmed)."""
        asked = self._ask_about_target("Cannot delete", lambda s, i: s.children(i))
        if asked is None:
            return
        target, kids = asked
        store, node_id = self.tierchat.store, target.info.node_id
        if len(kids) > 1:
            self.notify(
                f"This message has {len(kids)} branches after it. Delete a branch with "
                "Shift+D, or this message with everything after it.",
                title="Cannot delete one message",
                severity="warning",
                timeout=6,
            )
            return
        who = ROLE_NAMES.get(target.info.role, target.info.role)
        if kids:
            follow = ROLE_NAMES.get(kids[0].role, kids[0].role)
            body = (
                f"Only {who} message is deleted; {follow} message after it moves up "
                "and the rest of the conversation stays."
            )
            if kids[0].role == target.info.role or _parent_role(store, node_id) == kids[0].role:
                body += " Two messages of one role will then follow each other."
        else:
            body = f"{who.capitalize()} message is deleted (it is the last of its branch)."
        trash = self.tierchat.trash
        self._confirm_delete(
            "Delete message?", body, lambda: trash.delete_message(node_id), "Deleted the message."
        )

    def action_delete_branch(self) -> None:
        """Delete the message under the cursor and everything after it (confirmed)."""
        asked = self._ask_about_target("Cannot delete", lambda s, i: s.subtree_size(i))
        if asked is None:
            return
        target, size = asked
        node_id = target.info.node_id
        who = ROLE_NAMES.get(target.info.role, target.info.role)
        after = size - 1
        body = (
            f"{who.capitalize()} message and the {after} message{'s' if after != 1 else ''} "
            "after it, on every branch, are deleted."
            if after
            else f"{who.capitalize()} message is deleted (nothing follows it)."
        )
        note = f"Deleted {size} message{'s' if size != 1 else ''}."
        trash = self.tierchat.trash
        self._confirm_delete("Delete branch?", body, lambda: trash.delete_branch(node_id), note)

    def _confirm_delete(self, title: str, body: str, delete: Callable[[], Any], note: str) -> None:
        """Ask ``title``/``body`` in a :class:`ConfirmScreen`; on Delete, run ``delete()``
        through ``attempt`` ("Delete failed" on error) and refresh the chat, notifying
        ``note``."""

        async def done(confirmed: bool | None) -> None:
            if confirmed:
                ok, _ = await self.in_background("Delete failed", delete)
                if ok:
                    await self._after_delete(note)

        self.tierchat.push_screen(ConfirmScreen(title, body, confirm_label="Delete"), done)

    async def _after_delete(self, note: str) -> None:
        await self.resync(self.selected)
        self.host.conversations_changed()
        self.notify(f"{note} u on the messages undoes it.", timeout=4)

    # ------------------------------------------------------------------ the input

    def action_clear_input(self) -> None:
        box = self.query_one(ChatInput)  # type: ignore[attr-defined]
        if box.text:
            box.clear()  # an edit: Ctrl+Z brings the text back
            self.notify("Input cleared (Ctrl+Z brings it back).", timeout=2)
        box.focus()

    def action_edit_in_editor(self) -> None:
        """Edit the input in ``$VISUAL``/``$EDITOR`` with the terminal handed over
        (``App.suspend``); the edited text replaces the input, not sent."""
        box = self.query_one(ChatInput)  # type: ignore[attr-defined]
        try:
            try:
                with self.tierchat.suspend():
                    text = edit_text(box.text)
            except SuspendNotSupported:
                if not self.tierchat.is_headless:  # Textual Web: no terminal to hand over
                    raise EditorError("this terminal cannot be handed to an editor") from None
                text = edit_text(box.text)  # headless (tests): the editor needs no terminal
        except EditorError as e:
            self.notify(str(e), title="Editor", severity="error", timeout=6)
            return
        box.load_text(text)
        box.move_cursor(box.document.end)
        box.focus()
        self.draft_meter.changed()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ import

    def action_import_conversation(self) -> None:
        """Ask for an export's path (the exports folder first) and import it as a new
        conversation; a bad file is an error notification and stores nothing."""
        folder = Path(getattr(self.tierchat.settings, "data_dir", ".")) / "exports"

        async def done(path: str | None) -> None:
            if path:
                await self.import_file(Path(path))

        hint = "Enter to import · Esc to cancel · a .json export (path or whole tree)"
        self.tierchat.push_screen(
            PromptScreen("Import conversation from JSON", f"{folder}/", hint=hint), done
        )

    async def import_file(self, path: Path) -> int | None:
        """Import the export at ``path`` and open it; returns its id, None on error."""
        store = self.tierchat.store

        def load() -> tuple[int, Any]:
            conversation = read_export(path)
            return store.import_conversation(conversation), conversation

        ok, result = await self.in_background("Import failed", load)
        if not ok or result is None:
            return None
        cid, conversation = result
        self.host.open_conversation(cid)
        self.focus_input()
        title = conversation.title or f"conversation {cid}"
        self.notify(f"Imported “{title}” ({conversation.count()} messages).", title="Import")
        return cid

    # ------------------------------------------------------------------ one message, more

    async def action_fork(self) -> None:
        target = self.target()
        if target is None or target.info.node_id is None:
            return
        node_id = target.info.node_id
        fork = lambda: self.tierchat.session.fork(node_id)  # noqa: E731
        ok, new_id = await self.in_background("Fork failed", fork)
        if not ok or new_id is None:
            return
        self.host.open_conversation(new_id)
        self.focus_input()
        hint = " Ctrl+R generates its reply." if target.info.role == "user" else ""
        title = self.tierchat.store.get_conversation(new_id).title or f"conversation {new_id}"
        self.notify(f"Forked into “{title}”.{hint}")

    def action_copy(self) -> None:
        target = self.target()
        if target is None:
            return
        text = target.text
        self.tierchat.copy_to_clipboard(text)
        self.notify(f"Copied {len(text)} characters of the {target.info.role} message.")

    def action_toggle_reasoning(self) -> None:
        target = self.target()
        if target is None:
            return
        if not target.has_reasoning:
            self.notify("This reply has no reasoning (<think>…</think>) to show.", timeout=3)
            return
        target.toggle_reasoning()

    async def action_export(self, fmt: str = "md", scope: str = "path") -> None:
        """Write the open conversation (active path or whole tree) under the data dir."""
        from tierchat.tui.export import write_export

        cid, app = self.conversation_id, self.tierchat
        if cid is None:
            return
        data_dir = Path(getattr(app.settings, "data_dir", "."))
        write = lambda: write_export(app.store, data_dir, cid, fmt, scope)  # noqa: E731
        ok, path = await self.in_background("Export failed", write)
        if ok:
            self.notify(str(path), title="Exported")


def _parent_role(store: Any, node_id: int) -> str | None:
    parent = store.get_node(node_id).parent_id
    return store.get_node(parent).role if parent is not None else None
