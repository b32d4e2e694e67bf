"""ChatSession: one conversation, an engine and the store, glued together.

Used by the line chat, ``tierchat replay`` and the TUI. Every generating call (``send``,
``regenerate``, ``edit``) builds the prompt of the active path with
:func:`tierchat.core.prompts.build_prompt`, submits it, and returns a :class:`TurnHandle`.

What is stored, and when (events arrive on the engine thread):

- ``Finished``: the assistant node (text, generated token ids, ``meta`` = the turn's
  metrics as a dict + the model name) is added under the user node and selected *before*
  the event reaches the caller's ``on_event``, so a caller reacting to it sees the new
  active path.
- ``Finished`` with ``finish_reason == "cancelled"``: stored like any reply when at least
  one token was generated (meta says "cancelled", so the UI can mark it); with no token
  it is treated as a failure.
- ``Failed`` (or a cancel before any token): nothing half is kept: the user node this call
  added (``send``, ``edit``) is removed and the previous selection restored; the caller
  still has the text.
"""

from __future__ import annotations

import dataclasses
import threading

from tierchat.core.api import (
    EngineLike,
    Event,
    EventCallback,
    Failed,
    Finished,
    GenerateRequest,
    RequestHandle,
)
from tierchat.core.conversation import ConversationStore, Node
from tierchat.core.prompts import Prompt, PromptBuilder


class SessionError(Exception):
    """An operation the session cannot do now: no such turn/reply, nothing to regenerate,
    or a reply still being generated."""


class TurnHandle(RequestHandle):
    """One generating call: a :class:`RequestHandle` whose events are forwarded from the
    engine's handle after the session has handled them, so ``events()``, ``wait()`` and
    the caller's ``on_event`` all see a finished reply already stored and selected.
    ``user_node`` is the user message answered, ``reply_node`` the stored reply once
    finished (None before, and after a failure). ``kind`` is "send", "regenerate" or
    "edit"; ``prompt`` the prompt submitted; ``error`` an exception raised while storing
    the reply (the event is still forwarded)."""

    def __init__(
        self, kind: str, user_node: Node, prompt: Prompt, on_event: EventCallback | None = None
    ) -> None:
        super().__init__(on_event)
        self.kind = kind
        self.user_node = user_node
        self.prompt = prompt
        self.reply_node: Node | None = None
        self.error: Exception | None = None
        self._handle: RequestHandle | None = None

    @property
    def request_handle(self) -> RequestHandle:
        assert self._handle is not None
        return self._handle

    def cancel(self) -> None:
        super().cancel()
        if self._handle is not None:
            self._handle.cancel()


class ChatSession:
    """The conversation being chatted in, over an engine and a store.

    Generation parameters given here are the defaults of every call; ``max_tokens`` can
    be overridden per call. Thread-safe for one caller: one turn at a time (a generating
    call while a turn is in flight raises :class:`SessionError`).
    """

    def __init__(
        self,
        engine: EngineLike,
        store: ConversationStore,
        *,
        max_tokens: int = 512,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        use_cache: bool = True,
    ) -> None:
        self.engine = engine
        self.store = store
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.use_cache = use_cache
        self.conversation_id: int | None = None
        self.current: TurnHandle | None = None
        self._lock = threading.Lock()
        self._builder: PromptBuilder | None = None

    def build_prompt(self, path: list[Node]) -> Prompt:
        """The prompt for ``path`` with the engine's current tokenizer (renders cached
        across turns; a new tokenizer, after a model switch, starts a new cache)."""
        tokenizer = self.engine.tokenizer
        if self._builder is None or self._builder.tokenizer is not tokenizer:
            self._builder = PromptBuilder(tokenizer)
        return self._builder.build(path)

    # ------------------------------------------------------------------ conversation

    def new_conversation(self, system: str | None = None, title: str | None = None) -> int:
        """Create a conversation (``system`` as its root message), open it, return its id."""
        self.conversation_id = self.store.create_conversation(title, system=system)
        return self.conversation_id

    def open(self, conversation_id: int) -> None:
        """Make ``conversation_id`` current. Raises ``ConversationError`` if unknown."""
        self.store.get_conversation(conversation_id)
        self.conversation_id = conversation_id

    def _cid(self) -> int:
        if self.conversation_id is None:
            raise SessionError("no conversation is open")
        return self.conversation_id

    def active_path(self) -> list[Node]:
        """The messages the model sees, root first ([] when no conversation is open)."""
        if self.conversation_id is None:
            return []
        return self.store.active_path(self.conversation_id)

    def user_turns(self) -> list[Node]:
        """User nodes on the active path; turn ``i`` is ``user_turns()[i]``."""
        return self.store.user_turns(self._cid())

    def _user(self, turn: int) -> Node:
        users = self.user_turns()
        if not 0 <= turn < len(users):
            raise SessionError(f"no user turn {turn} (the active path has {len(users)})")
        return users[turn]

    def replies(self, turn: int) -> list[Node]:
        """Replies to user turn ``turn`` in creation order (the swipe order)."""
        return self.store.replies(self._user(turn).id)

    def selected_reply(self, turn: int) -> tuple[int, int]:
        """``(index, count)`` of the reply shown for user turn ``turn``; index -1 if none."""
        user = self._user(turn)
        replies = self.store.replies(user.id)
        chosen = self.store.selected_child(user.id)
        ids = [r.id for r in replies]
        return (ids.index(chosen.id) if chosen and chosen.id in ids else -1, len(replies))

    def swipe(self, turn: int, index: int) -> Node:
        """Select reply ``index`` (negative counts from the end) of user turn ``turn``;
        no generation. Returns the selected reply. Raises :class:`SessionError`."""
        user = self._user(turn)
        replies = self.store.replies(user.id)
        if not -len(replies) <= index < len(replies):
            raise SessionError(f"user turn {turn} has no reply {index} ({len(replies)} replies)")
        self.store.select_child(user.id, replies[index].id)
        return replies[index]

    def fork(self, node_id: int) -> int:
        """Copy the path root..``node_id`` into a new conversation; returns its id (the
        session stays on the current conversation: ``open()`` the fork to continue it)."""
        return self.store.fork(node_id)

    def delete(self, node_id: int) -> None:
        """Delete ``node_id`` and everything under it."""
        self.store.delete_subtree(node_id)

    def rename(self, title: str | None) -> None:
        self.store.rename(self._cid(), title)

    @property
    def busy(self) -> bool:
        """A turn is being generated."""
        return self.current is not None and not self.current.done

    # ------------------------------------------------------------------ generation

    def send(
        self, text: str, *, max_tokens: int | None = None, on_event: EventCallback | None = None
    ) -> TurnHandle:
        """Append a user message to the active path and generate a reply to it.

        Opens a new conversation first when none is open. Raises :class:`SessionError`
        while another turn is in flight.
        """
        with self._lock:
            self._check_idle()
            if self.conversation_id is None:
                self.new_conversation()
            path = self.active_path()
            parent = path[-1].id if path else None
            user = self.store.add_node(self._cid(), parent, "user", text)
            return self._generate("send", user, None, max_tokens, on_event)

    def regenerate(
        self, *, max_tokens: int | None = None, on_event: EventCallback | None = None
    ) -> TurnHandle:
        """Generate a new reply to the last user message of the active path, as a sibling
        of the reply shown (or the first reply when the path ends in a user message).
        Raises :class:`SessionError` when there is no user message."""
        with self._lock:
            self._check_idle()
            path = self.active_path()
            users = [i for i, n in enumerate(path) if n.role == "user"]
            if not users:
                raise SessionError("nothing to regenerate: no user message on the active path")
            user = path[users[-1]]
            return self._generate("regenerate", user, None, max_tokens, on_event)

    def edit(
        self,
        turn: int,
        text: str,
        *,
        max_tokens: int | None = None,
        on_event: EventCallback | None = None,
    ) -> TurnHandle:
        """Replace user turn ``turn`` by ``text`` as a new branch (a sibling user node, now
        selected) and generate its reply. Raises :class:`SessionError` for a bad turn."""
        with self._lock:
            self._check_idle()
            old = self._user(turn)
            user = self.store.add_node(self._cid(), old.parent_id, "user", text)
            return self._generate("edit", user, old, max_tokens, on_event)

    def _check_idle(self) -> None:
        if self.busy:
            raise SessionError("a reply is still being generated")

    def _generate(
        self,
        kind: str,
        user: Node,
        restore: Node | None,
        max_tokens: int | None,
        on_event: EventCallback | None,
    ) -> TurnHandle:
        """Submit the prompt for the path ending at ``user``. ``kind`` "send"/"edit" added
        ``user`` and remove it again on failure (reselecting ``restore``)."""
        added = kind in ("send", "edit")
        try:
            prompt = self.build_prompt(self.store.path_to(user.id))
        except Exception:
            if added:
                self._rollback(user, restore)
            raise
        turn = TurnHandle(kind, user, prompt, on_event)
        request = GenerateRequest(
            prompt_ids=prompt.token_ids,
            max_tokens=max_tokens if max_tokens is not None else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            boundaries=prompt.boundaries,
            use_cache=self.use_cache,
        )

        def handle_event(event: Event) -> None:
            if isinstance(event, Finished):
                self._finished(turn, event, added, restore)
            elif isinstance(event, Failed) and added:
                self._safely(turn, lambda: self._rollback(user, restore))
            turn.emit(event)

        try:
            turn._handle = self.engine.submit(request, handle_event)
        except Exception:
            if added:
                self._rollback(user, restore)
            raise
        self.current = turn
        return turn

    def _finished(self, turn: TurnHandle, event: Finished, added: bool, restore) -> None:
        metrics = event.metrics
        if metrics.finish_reason == "cancelled" and not event.token_ids:
            if added:
                self._safely(turn, lambda: self._rollback(turn.user_node, restore))
            return
        meta = dataclasses.asdict(metrics)
        meta["model"] = self.engine.model_name

        def store() -> None:
            turn.reply_node = self.store.add_node(
                turn.user_node.conversation_id,
                turn.user_node.id,
                "assistant",
                event.text,
                token_ids=event.token_ids,
                meta=meta,
            )

        self._safely(turn, store)

    def _safely(self, turn: TurnHandle, action) -> None:
        try:
            action()
        except Exception as e:  # noqa: BLE001 -- never raise into the engine thread
            turn.error = e

    def _rollback(self, user: Node, restore: Node | None) -> None:
        self.store.delete_subtree(user.id)
        if restore is not None:
            self.store.select_child(restore.parent_id, restore.id)
