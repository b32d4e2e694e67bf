"""One generating call of a chat session (docs/DESIGN.md §12): the engine's request handle
seen through the session, which stores the reply before its ``Finished`` is forwarded."""

from __future__ import annotations

from typing import Any

from ..api import EventCallback, GenerateRequest, RequestHandle
from .prompts import Prompt
from .store import Node


class TurnHandle(RequestHandle):
    """One generating call: a :class:`RequestHandle` whose events are forwarded from the
    engine's handle after the session has handled them, so ``events()``, ``wait()`` and
    the caller's ``on_event`` all see a finished reply already stored and selected.
    ``user_node`` is the message answered (a user message, or the tool result a tool
    round's next step follows), ``reply_node`` the stored reply once finished (None
    before, and after a failure). ``kind`` is "send", "regenerate", "edit", "continue"
    or "round" (the next step of a tool round); ``prompt`` the prompt of the path to
    ``user_node``; ``tools`` the function tools it rendered; ``error`` an exception raised
    while storing the reply (the event is still forwarded)."""

    def __init__(
        self, kind: str, user_node: Node, prompt: Prompt, on_event: EventCallback | None = None
    ) -> None:
        super().__init__(on_event)
        self.kind = kind
        self.user_node = user_node
        self.prompt = prompt
        self.reply_node: Node | None = None
        self.continued: Node | None = None  # the reply a "continue" extends
        self.tools: list[dict[str, Any]] = []  # the function tools the prompt rendered
        self.error: Exception | None = None
        self.request: GenerateRequest | None = None
        self._handle: RequestHandle | None = None

    @property
    def request_handle(self) -> RequestHandle:
        assert self._handle is not None
        return self._handle

    def attach(self, handle: RequestHandle) -> None:
        """The engine's handle of this turn's request (set once, at submit)."""
        self._handle = handle

    def cancel(self) -> None:
        super().cancel()
        if self._handle is not None:
            self._handle.cancel()
