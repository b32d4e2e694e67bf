"""The chat screen's actions on a whole conversation: rename, delete (undo brings it
back, core/chat/trash.py), its settings (``screens/conversation_settings.py``) and its
automatic title, which follows the first message kept.
:class:`ConversationActions` does the work of the screen's actions of those names,
through :class:`ConversationHost`; store writes run on the background writer
(docs/DESIGN.md §16).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from tierchat.tui.screens.confirm import ConfirmScreen
from tierchat.tui.screens.conversation_settings import ConversationSettingsScreen, reuse_note
from tierchat.tui.screens.prompt import PromptScreen
from tierchat.tui.widgets.conversation_list import ConversationList

if TYPE_CHECKING:
    from tierchat.tui.app import TierchatApp


AUTO_TITLES = (None, "untitled")
"""Titles no one chose: none yet, or the literal "untitled" older versions stored for a
conversation made by a settings save. A first message kept replaces them."""


def title_from(text: str, width: int = 40) -> str:
    """A conversation title from its first message: first line, at most ``width`` chars."""
    line = text.strip().splitlines()[0] if text.strip() else "untitled"
    return line if len(line) <= width else line[: width - 1].rstrip() + "…"


def _has_user_message(store: Any, conversation_id: int) -> bool:
    return any(n.role == "user" for n in store.active_path(conversation_id))


def title_first_message(store: Any, conversation_id: int, text: str) -> bool:
    """Title the conversation after ``text`` when it has no title of anyone's choosing
    and no user message yet (store thread). True when the title changed."""
    info = store.get_conversation(conversation_id)
    if info.title not in AUTO_TITLES or _has_user_message(store, conversation_id):
        return False
    store.rename(conversation_id, title_from(text))
    return True


def untitle_withdrawn(store: Any, conversation_id: int, text: str) -> bool:
    """After the user message ``text`` was dropped: the conversation's title, when it
    was made from that message and no user message is left, goes back to none (store
    thread). True when the title changed."""
    info = store.get_conversation(conversation_id)
    if info.title != title_from(text) or _has_user_message(store, conversation_id):
        return False
    store.rename(conversation_id, None)
    return True


class ConversationHost(Protocol):
    """What :class:`ConversationActions` needs of the chat screen."""

    @property
    def conversation_id(self) -> int | None:
        """The conversation shown."""

    def conversations_changed(self) -> None:
        """The list, the titles and the keys follow the store."""

    def new_conversation(self) -> None:
        """Show an empty new conversation."""

    def ensure_conversation(self, first_text: str | None) -> Awaitable[bool]:
        """Create the conversation shown if it is new (False after an error)."""

    def replying(self, conversation_id: int) -> bool:
        """A reply of ``conversation_id`` is in flight."""

    def settings_changed(self) -> None:
        """The shown conversation's settings were saved: the transcript shows them."""


class ConversationActions:
    """Rename, delete and settings of the open conversation (delete: of the one
    highlighted in ``listing`` when it has the focus)."""

    def __init__(self, host: ConversationHost, app: TierchatApp, listing: ConversationList):
        self.host = host
        self.app = app
        self.listing = listing

    def rename(self) -> None:
        app, cid = self.app, self.host.conversation_id
        if cid is None:
            return
        info = app.store.get_conversation(cid)

        async def done(title: str | None) -> None:
            if title is None:
                return
            rename = lambda: app.store.rename(cid, title)  # noqa: E731
            if not (await app.in_background("Rename failed", rename))[0]:
                return
            self.host.conversations_changed()
            app.notify(f"Renamed to “{title}”")

        app.push_screen(PromptScreen("Rename conversation", info.title or ""), done)

    def delete(self) -> None:
        app, host, listing = self.app, self.host, self.listing
        from_list = listing.has_focus
        cid = listing.highlighted_id if from_list else host.conversation_id
        if cid is None:
            return
        if host.replying(cid):
            app.notify("A reply of that conversation is streaming; stop it first.")
            return
        info = app.store.get_conversation(cid)
        title = info.title or f"conversation {cid}"

        async def done(confirmed: bool | None) -> None:
            if not confirmed:
                return
            delete = lambda: app.trash.delete_conversation(cid)  # noqa: E731
            if not (await app.in_background("Delete failed", delete))[0]:
                return
            if cid == host.conversation_id:
                host.new_conversation()
            host.conversations_changed()
            if from_list:  # u there brings it back
                listing.focus()
            app.notify(f"Deleted “{title}”; u undoes it (the list or the messages).")

        body = f"“{title}” and every branch in it will be deleted from the store."
        app.push_screen(ConfirmScreen("Delete conversation?", body, confirm_label="Delete"), done)

    def settings(self, title: str) -> None:
        """The settings dialog of the open conversation (``title`` in its header)."""
        app, session = self.app, self.app.session
        ok, current = app.attempt("Cannot read settings", lambda: session.settings())
        if not ok or current is None:
            return

        async def done(new) -> None:
            if new is None or new == current:
                return
            if not await self.host.ensure_conversation(None):
                return
            save = lambda: session.save_settings(new)  # noqa: E731
            if not (await app.in_background("Cannot save settings", save))[0]:
                return
            self.host.settings_changed()
            note = reuse_note(session, new.system, current) if new.system != current.system else ""
            extra = f" {note}" if note else ""
            app.notify(f"Saved for this conversation.{extra}", title="Settings")

        screen = ConversationSettingsScreen(
            current,
            title,
            reuse_note=lambda system: reuse_note(session, system, current),
            default_temperature=session.defaults.sampling.temperature,
            servers=app.tools.server_names(),
        )
        app.push_screen(screen, done)

    async def first_message(self, conversation_id: int, text: str) -> None:
        """``text`` is about to be sent in ``conversation_id``: an untitled conversation
        without messages takes its title (:func:`title_first_message`)."""
        store = self.app.store
        call = lambda: title_first_message(store, conversation_id, text)  # noqa: E731
        ok, changed = await self.app.in_background("Cannot update the title", call)
        if ok and changed:
            self.host.conversations_changed()
