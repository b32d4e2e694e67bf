"""The chat screen's actions on a whole conversation: rename, delete (undo brings it
back, core/chat/trash.py), its settings (``screens/conversation_settings.py``) and its
automatic title, which follows the first message kept.
Composed into ``ChatScreen`` (``screen.conversation_actions``), whose actions of those
names call it; store writes run on the background writer (docs/DESIGN.md §16).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierchat.tui.screens.confirm import ConfirmScreen
from tierchat.tui.screens.conversation_settings import ConversationSettingsScreen, reuse_note
from tierchat.tui.screens.prompt import PromptScreen
from tierchat.tui.widgets.conversation_list import ConversationList

if TYPE_CHECKING:
    from tierchat.tui.screens.chat import ChatScreen


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


class ConversationActions:
    """Rename, delete and settings of the open conversation (delete: of the one
    highlighted in the list when the list has the focus)."""

    def __init__(self, chat: ChatScreen) -> None:
        self.chat = chat

    def rename(self) -> None:
        chat = self.chat
        cid = chat.conversation_id
        if cid is None:
            return
        info = chat.tierchat.store.get_conversation(cid)

        async def done(title: str | None) -> None:
            if title is None:
                return
            rename = lambda: chat.tierchat.store.rename(cid, title)  # noqa: E731
            if not (await chat.in_background("Rename failed", rename))[0]:
                return
            chat.refresh_conversations()
            chat._update_titles()
            chat.notify(f"Renamed to “{title}”")

        chat.app.push_screen(PromptScreen("Rename conversation", info.title or ""), done)

    def delete(self) -> None:
        chat = self.chat
        listing = chat.query_one(ConversationList)
        from_list = listing.has_focus
        cid = listing.highlighted_id if from_list else chat.conversation_id
        if cid is None:
            return
        if chat.turns.streaming(cid):
            chat.notify("A reply of that conversation is streaming; stop it first.")
            return
        info = chat.tierchat.store.get_conversation(cid)
        title = info.title or f"conversation {cid}"

        async def done(confirmed: bool | None) -> None:
            if not confirmed:
                return
            trash = chat.tierchat.trash
            delete = lambda: trash.delete_conversation(cid)  # noqa: E731
            if not (await chat.in_background("Delete failed", delete))[0]:
                return
            if cid == chat.conversation_id:
                chat.action_new_conversation()
            chat.refresh_conversations()
            chat.refresh_bindings()
            if from_list:  # u there brings it back
                listing.focus()
            chat.notify(f"Deleted “{title}”; u undoes it (the list or the messages).")

        body = f"“{title}” and every branch in it will be deleted from the store."
        chat.app.push_screen(
            ConfirmScreen("Delete conversation?", body, confirm_label="Delete"), done
        )

    def settings(self) -> None:
        chat = self.chat
        session = chat.tierchat.session
        ok, current = chat.attempt("Cannot read settings", lambda: session.settings())
        if not ok or current is None:
            return
        title = chat.sub_title.split(" · ")[-1]

        async def done(new) -> None:
            if new is None or new == current:
                return
            if not await chat._ensure_conversation(None):
                return
            save = lambda: session.save_settings(new)  # noqa: E731
            if not (await chat.in_background("Cannot save settings", save))[0]:
                return
            chat.sync_transcript()
            note = reuse_note(session, new.system, current) if new.system != current.system else ""
            extra = f" {note}" if note else ""
            chat.notify(f"Saved for this conversation.{extra}", title="Settings")

        screen = ConversationSettingsScreen(
            current,
            title,
            reuse_note=lambda system: reuse_note(session, system, current),
            default_temperature=session.defaults.sampling.temperature,
        )
        chat.app.push_screen(screen, done)

    async def first_message(self, conversation_id: int, text: str) -> None:
        """``text`` is about to be sent in ``conversation_id``: an untitled conversation
        without messages takes its title (:func:`title_first_message`)."""
        store = self.chat.tierchat.store
        call = lambda: title_first_message(store, conversation_id, text)  # noqa: E731
        await self._retitled(call)

    async def withdrawn(self, conversation_id: int, text: str) -> None:
        """The session dropped the user message ``text``: a title it gave goes
        (:func:`untitle_withdrawn`)."""
        store = self.chat.tierchat.store
        call = lambda: untitle_withdrawn(store, conversation_id, text)  # noqa: E731
        await self._retitled(call)

    async def _retitled(self, call) -> None:
        ok, changed = await self.chat.in_background("Cannot update the title", call)
        if ok and changed:
            self.chat.refresh_conversations()
            self.chat._update_titles()
