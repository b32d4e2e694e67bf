"""Every Textual message of the app, each a small dataclass named for what happened.

Engine events arrive on the engine's own thread; the callbacks in ``screens/chat/`` turn
them into these messages with ``post_message`` (thread-safe) and never touch a widget.
High-rate ones (:class:`ReplyStreamed`, :class:`PrefillAdvanced`, :class:`ModelLoadAdvanced`)
carry cumulative state and implement ``can_replace``, so a burst of them collapses into the
newest one without losing text.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message
from textual.widget import Widget
from tierchat.core.api import TurnMetrics


@dataclass
class PrefillAdvanced(Message):
    """The prompt of generation ``turn_key`` is ``done`` of ``total`` tokens prefilled."""

    turn_key: int
    done: int
    total: int
    tps: float

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, PrefillAdvanced) and message.turn_key == self.turn_key


@dataclass
class ReplyStreamed(Message):
    """Generation ``turn_key`` has produced ``text`` so far (cumulative, not a delta)."""

    turn_key: int
    text: str
    tokens: int

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ReplyStreamed) and message.turn_key == self.turn_key


@dataclass
class ReplyFinished(Message):
    """Generation ``turn_key`` completed (or was stopped); the session has stored the reply."""

    turn_key: int
    text: str
    metrics: TurnMetrics


@dataclass
class ReplyFailed(Message):
    """Generation ``turn_key`` did not complete. ``kind``: "error", "refused", "unsupported",
    "cancelled"; ``kept_tokens``: prompt tokens a cancelled prefill kept in the cache."""

    turn_key: int
    message: str
    kind: str
    kept_tokens: int = 0


@dataclass
class VerifyAdvanced(Message):
    """A verify against cold (core/chat/verify.py) has run ``done`` of ``total`` token
    positions of its three runs (cumulative)."""

    done: int
    total: int

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, VerifyAdvanced)


@dataclass
class VerifyEnded(Message):
    """A verify against cold ended: ``report`` (a ``VerifyReport``) when it completed,
    ``stopped`` when its cancel was set, else ``error`` says why it failed."""

    report: object = None
    stopped: bool = False
    error: str = ""


@dataclass
class ModelLoadAdvanced(Message):
    """Loading ``model`` is at step ``done`` of ``total``."""

    model: str
    done: int
    total: int
    note: str

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ModelLoadAdvanced) and message.model == self.model


@dataclass
class ModelLoadFinished(Message):
    """``model`` is loaded on the engine; ``warning`` is set when caching is off for it."""

    model: str
    warning: str | None


@dataclass
class ModelLoadFailed(Message):
    """Loading ``model`` failed; the previous model (if any) stays."""

    model: str
    message: str


@dataclass
class ConversationChosen(Message):
    """The user picked conversation ``conversation_id`` in the list."""

    conversation_id: int


@dataclass
class MessageSubmitted(Message):
    """The chat input was submitted with ``text`` (already stripped, never empty)."""

    text: str


@dataclass
class BranchRequested(Message):
    """A click on a message's branch bar: ``action`` is "prev", "next", "regenerate",
    "edit", "fork" or "copy", for the message of node ``node_id``."""

    node_id: int
    action: str


@dataclass
class MessageClicked(Message):
    """The user clicked the message widget ``view`` (to select it)."""

    view: Widget


@dataclass
class TypedInTranscript(Message):
    """A printable key the message cursor does not bind: it belongs in the chat input."""

    character: str


@dataclass
class PathShown(Message):
    """The transcript now shows another path: ``node_ids``, root first (a swipe, an
    edit, a reply stored, another conversation opened)."""

    node_ids: tuple[int | None, ...]


@dataclass
class KeyHandled(Message):
    """Key number ``seq`` went through the widgets: it was handled, or came back up to
    the app and ran its binding (``tui/terminal.py``, ``KeyOrder``)."""

    seq: int
