"""The chat screen and its parts (docs/DESIGN.md §16): ``screen.py`` (the layout, the
conversation shown, the screen-wide keys), ``pane.py`` (the message pane: cursor,
replies, input, the actions on messages), ``message_actions.py`` (the pane's actions
beyond chatting), ``conversations.py`` and ``models.py`` (the screen's conversation and
model work, through host Protocols)."""

from tierchat.tui.screens.chat.screen import STATS_POLL_S, WIDE_COLUMNS, ChatScreen, title_from

__all__ = ["STATS_POLL_S", "WIDE_COLUMNS", "ChatScreen", "title_from"]
