"""The chat screen and its parts (docs/DESIGN.md §16): ``screen.py`` (the layout and the
screen's keys), ``tools.py``, ``conversations.py``, ``models.py``."""

from tierchat.tui.screens.chat.screen import STATS_POLL_S, WIDE_COLUMNS, ChatScreen, title_from

__all__ = ["STATS_POLL_S", "WIDE_COLUMNS", "ChatScreen", "title_from"]
