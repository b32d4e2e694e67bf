"""ChatSession: one conversation, an engine and the store, glued together.

Used by the line chat, ``tierchat replay`` and the TUI. Every generating call (``send``,
``regenerate``, ``edit``) builds the prompt of the active path with
:func:`tierchat.core.chat.prompts.build_prompt`, submits it, and returns a :class:`TurnHandle`.

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
- A prompt whose tokens plus ``max_tokens`` do not fit the model's context is refused
  before it is submitted (:class:`ContextLimitError`, with the numbers and what to do);
  the user node is removed as for a failure.

Generation settings (system prompt, sampling, swipe temperature) are per conversation
(:class:`~tierchat.core.chat.conversation_settings.ConversationSettings`, saved in the
store with it); the session's ``defaults`` are those of a conversation that saved none. With
temperature > 0 and a seed, reply ``k`` to a user message is sampled with ``seed + k``, so
regenerate gives a new reply and a replay gives the same ones.

A reply's generated token ids are spliced into later prompts only while the model that
generated them is loaded (``meta["model"]``); after a model switch its text is tokenized
by the new model instead (another model's ids are another vocabulary).

Tools (docs/DESIGN.md §12.1): a conversation whose settings name MCP servers gets their
tools (from :attr:`ChatSession.tools`) in every prompt; a reply's calls are stored in its
meta, and :class:`~tierchat.core.chat.tool_rounds.ToolRounds` runs the rounds.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from ..api import (
    EngineLike,
    Event,
    EventCallback,
    Failed,
    Finished,
    GenerateRequest,
    Stopping,
)
from ..sampling_params import SEED_LIMIT
from .context_limit import ContextLimitExceeded, context_length, generation_room
from .conversation_settings import ConversationSettings
from .prompts import Prompt, PromptBuilder, decode_ids
from .store import ConversationStore, Node, PathEntry
from .tool_calls import ReplyFormat
from .tool_rounds_logic import reply_meta
from .trash import Trash
from .turn_handle import TurnHandle

__all__ = ["ChatSession", "ContextLimitError", "ConversationSettings", "SessionError", "TurnHandle"]


class ToolCatalog(Protocol):
    """Where a session gets a conversation's tools: an
    :class:`~tierchat.core.tools.mcp_host.McpHost`, or a stand-in in tests."""

    def specs(self, servers: Sequence[str]) -> list[dict[str, Any]]:
        """OpenAI function tools of ``servers`` (in a stable order)."""


# the OpenAI chat fields a node's meta gives its prompt message, by role
_MESSAGE_FIELDS = {
    "assistant": ("tool_calls", "reasoning_content"),
    "tool": ("tool_call_id", "name"),
}


class SessionError(Exception):
    """An operation the session cannot do now: no such turn/reply, nothing to regenerate,
    or a reply still being generated."""


class ContextLimitError(SessionError):
    """The prompt cannot fit the model's context (nothing was submitted); ``limit`` is the
    :class:`~tierchat.core.chat.context_limit.ContextLimitExceeded` with the numbers."""

    def __init__(self, limit: ContextLimitExceeded) -> None:
        super().__init__(str(limit))
        self.limit = limit


class ChatSession:
    """The conversation being chatted in, over an engine and a store.

    ``defaults``: the settings of a conversation that saved none; ``max_tokens`` can be
    overridden per call. Thread-safe; one turn in flight per conversation (a generating
    call for a conversation whose turn is still in flight raises :class:`SessionError`),
    so turns of different conversations run at once, batched by the engine
    (docs/DESIGN.md §20). Generating calls take ``conversation_id`` (default: the open one)
    so a caller on another thread never depends on which conversation is open.
    """

    @classmethod
    def from_settings(
        cls, engine: EngineLike, store: ConversationStore, settings: Any, *, swipes: bool = True
    ) -> ChatSession:
        """A session with ``settings``' generation defaults (a ``config.settings.Settings``:
        its ``sampling`` and ``swipe_temperature``); ``swipes`` False keeps regenerates at
        the conversation's temperature (``replay``: a regenerate without "temperature" is
        greedy, as its format says)."""
        defaults = ConversationSettings(
            sampling=settings.sampling,
            swipe_temperature=settings.swipe_temperature if swipes else 0.0,
        )
        return cls(engine, store, defaults, use_cache=not settings.no_cache)

    def __init__(
        self,
        engine: EngineLike,
        store: ConversationStore,
        defaults: ConversationSettings | None = None,
        *,
        use_cache: bool = True,
    ) -> None:
        self.engine = engine
        self.store = store
        # the settings of a conversation that saved none
        self.defaults = defaults if defaults is not None else ConversationSettings()
        self.use_cache = use_cache
        self.conversation_id: int | None = None
        self.current: TurnHandle | None = None  # the turn submitted last
        self._turns: dict[int, TurnHandle] = {}  # the last turn of each conversation
        self._lock = threading.Lock()
        self._builder: PromptBuilder | None = None
        self.tools: ToolCatalog | None = None  # the conversations' tools (docs/DESIGN.md §12.1)

    # ------------------------------------------------------------------ settings

    def settings(self, conversation_id: int | None = None) -> ConversationSettings:
        """The settings of ``conversation_id`` (default: the open one; the defaults when
        none is open). A system message at the root of the tree is the default system
        prompt."""
        cid = self.conversation_id if conversation_id is None else conversation_id
        if cid is None:
            return self.defaults
        return ConversationSettings.saved(self.store, cid, self.defaults)

    def save_settings(self, settings: ConversationSettings) -> None:
        """Save ``settings`` (checked when they were made) with the open conversation.
        Raises :class:`SessionError` when no conversation is open."""
        self.store.set_conversation_settings(self._cid(), settings.to_dict())

    # ------------------------------------------------------------------ prompts

    def prompt_messages(
        self,
        path: list[Node],
        settings: ConversationSettings | None = None,
        *,
        as_written: bool = True,
    ):
        """What the model sees for ``path``: the conversation's system prompt first (it
        replaces a stored system root), and no generated ids from another model. An
        assistant step's calls and a tool result carry their OpenAI chat fields from
        ``meta`` (``tool_calls``, ``reasoning_content``; ``tool_call_id``, ``name``); a
        step whose calls were bare (``meta["as_written"]``, core/chat/tool_rounds_logic.py) is its
        text as the model wrote it while its ids are the loaded model's (``as_written``
        False: its calls instead), so its generated ids splice (docs/DESIGN.md §4)."""
        settings = settings or self.settings(path[0].conversation_id if path else None)
        model = self.engine.model_name
        body = path[1:] if path and path[0].role == "system" else list(path)
        out: list[Any] = []
        if settings.system:
            out.append({"role": "system", "content": settings.system, "token_ids": None})
        for node in body:
            ids = node.token_ids
            meta = node.meta or {}
            if ids is not None and meta.get("model", model) != model:
                ids = None
            message = {"role": node.role, "content": node.content, "token_ids": ids}
            if as_written and ids and isinstance(meta.get("as_written"), str):
                out.append({**message, "content": meta["as_written"]})
                continue
            for key in _MESSAGE_FIELDS.get(node.role, ()):
                if meta.get(key):
                    message[key] = meta[key]
            out.append(message)
        return out

    def tool_specs(self, settings: ConversationSettings) -> list[dict[str, Any]]:
        """The OpenAI function tools the model gets under ``settings`` (its ``tools``
        servers, from :attr:`tools`); [] when none."""
        if not settings.tools or self.tools is None:
            return []
        return self.tools.specs(settings.tools)

    def build_prompt(
        self,
        path: list[Any],
        settings: ConversationSettings | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> Prompt:
        """The prompt for ``path`` (nodes, or role/content dicts) with the engine's current
        tokenizer (renders cached across turns; a new tokenizer, after a model switch,
        starts a new cache); ``tools`` (OpenAI function tools) rendered by the template.
        Raises :class:`SessionError` when no model is loaded."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not self.engine.model_name:
            raise SessionError("no model is loaded yet: pick one (F4) or wait for it to load")
        nodes = path if path and isinstance(path[0], Node) else None
        if not path or nodes is not None:
            path = self.prompt_messages(path, settings)
        if self._builder is None or self._builder.tokenizer is not tokenizer:
            self._builder = PromptBuilder(tokenizer, check_whole=False)
        try:
            return self._builder.build(path, tools=tools or None)
        except Exception:
            if nodes is None or not any("as_written" in (n.meta or {}) for n in nodes):
                raise
            # a template that wants a result's call on the step before: render the calls
            path = self.prompt_messages(nodes, settings, as_written=False)
            return self._builder.build(path, tools=tools or None)

    # ------------------------------------------------------------------ conversation

    def new_conversation(self, system: str | None = None, title: str | None = None) -> int:
        """Create a conversation (``system`` as its root message), open it, return its id."""
        self.conversation_id = self.store.create_conversation(title, system=system)
        return self.conversation_id

    def open(self, conversation_id: int) -> None:
        """Make ``conversation_id`` current. Raises ``ConversationError`` if unknown."""
        self.store.get_conversation(conversation_id)
        self.conversation_id = conversation_id

    def _cid(self, conversation_id: int | None = None) -> int:
        if conversation_id is not None:
            return conversation_id
        if self.conversation_id is None:
            raise SessionError("no conversation is open")
        return self.conversation_id

    def active_path(self) -> list[Node]:
        """The messages the model sees, root first ([] when no conversation is open)."""
        if self.conversation_id is None:
            return []
        return self.store.active_path(self.conversation_id)

    def path_entries(self) -> list[PathEntry]:
        """The active path with each node's place among its siblings, in one store query
        ([] when no conversation is open)."""
        if self.conversation_id is None:
            return []
        return self.store.active_path_entries(self.conversation_id)

    def select(self, node_id: int) -> Node:
        """Make ``node_id`` the selected one among its siblings (any role: a reply, an
        edited user message, a system prompt branch); no generation. Returns the node."""
        node = self.store.get_node(node_id)
        self.store.select_child(node.parent_id, node.id)
        return node

    def user_turns(self, conversation_id: int | None = None) -> list[Node]:
        """User nodes on the active path (of ``conversation_id``, default the open
        conversation); turn ``i`` is ``user_turns()[i]``."""
        return self.store.user_turns(self._cid(conversation_id))

    def _user(self, turn: int, conversation_id: int | None = None) -> Node:
        """User turn ``turn`` of the active path (negative counts from the end)."""
        users = self.user_turns(conversation_id)
        if not -len(users) <= turn < len(users):
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
        """Copy the path root..``node_id`` into a new conversation, with the settings of
        the conversation it came from; returns its id (the session stays on the current
        conversation: ``open()`` the fork to continue it)."""
        old = self.store.get_node(node_id).conversation_id
        saved = self.store.conversation_settings(old)
        cid = self.store.fork(node_id)
        if saved:
            self.store.set_conversation_settings(cid, saved)
        return cid

    def delete(self, node_id: int) -> None:
        """Delete ``node_id`` and everything under it."""
        self.store.delete_subtree(node_id)

    def rename(self, title: str | None) -> None:
        self.store.rename(self._cid(), title)

    @property
    def busy(self) -> bool:
        """A turn of the open conversation is being generated."""
        return self.in_flight(self.conversation_id) is not None

    def in_flight(self, conversation_id: int | None) -> TurnHandle | None:
        """The turn of ``conversation_id`` still being generated, None when none."""
        turn = self._turns.get(conversation_id) if conversation_id is not None else None
        return turn if turn is not None and not turn.done else None

    # ------------------------------------------------------------------ generation

    def send(
        self,
        text: str,
        *,
        max_tokens: int | None = None,
        on_event: EventCallback | None = None,
        conversation_id: int | None = None,
    ) -> TurnHandle:
        """Append a user message to the active path of ``conversation_id`` (default: the
        open one) and generate a reply to it.

        Opens a new conversation first when none is given or open. Raises
        :class:`SessionError` while a turn of that conversation is in flight.
        """
        with self._lock:
            if conversation_id is None and self.conversation_id is None:
                self.new_conversation()
            cid = self._cid(conversation_id)
            self._check_idle(cid)
            path = self.store.active_path(cid)
            parent = path[-1].id if path else None
            user = self.store.add_node(cid, parent, "user", text)
            return self._generate("send", user, None, max_tokens, on_event)

    def regenerate(
        self,
        *,
        turn: int | None = None,
        max_tokens: int | None = None,
        on_event: EventCallback | None = None,
        conversation_id: int | None = None,
    ) -> TurnHandle:
        """Generate a new reply to user turn ``turn`` of the active path (default: the
        last; negative counts from the end), as a sibling of the reply shown there (or
        its first reply when it has none). The new reply is selected, so the active
        path now ends at it. Its prompt is the path up to that user message: the prompt
        of the reply it is a sibling of. Raises :class:`SessionError` when there is no
        such user message."""
        with self._lock:
            cid = self.conversation_id if conversation_id is None else conversation_id
            self._check_idle(cid)
            users = self.user_turns(cid) if cid is not None else []
            if not users:
                raise SessionError("nothing to regenerate: no user message on the active path")
            index = len(users) - 1 if turn is None else turn
            if not -len(users) <= index < len(users):
                raise SessionError(f"no user turn {turn} (the active path has {len(users)})")
            return self._generate("regenerate", users[index], None, max_tokens, on_event)

    def edit(
        self,
        turn: int,
        text: str,
        *,
        max_tokens: int | None = None,
        on_event: EventCallback | None = None,
        conversation_id: int | None = None,
    ) -> TurnHandle:
        """Replace user turn ``turn`` by ``text`` as a new branch (a sibling user node, now
        selected) and generate its reply. Raises :class:`SessionError` for a bad turn."""
        with self._lock:
            cid = self._cid(conversation_id)
            self._check_idle(cid)
            old = self._user(turn, cid)
            user = self.store.add_node(cid, old.parent_id, "user", text)
            return self._generate("edit", user, old, max_tokens, on_event)

    def continue_reply(
        self,
        reply_id: int | None = None,
        *,
        max_tokens: int | None = None,
        on_event: EventCallback | None = None,
    ) -> TurnHandle:
        """Generate more of reply ``reply_id`` (default: the last reply of the active path;
        one cut at ``max_tokens`` or stopped). The prompt is that reply's prompt followed
        by its generated ids, so the resident cache that ended with it restores all of it
        with the logprobs after its last token (docs/DESIGN.md §8.1): nothing prefilled.
        The reply grows in place (one swipe): its content, ids (old + new) and meta (this
        generation's metrics, ``continued``: how many times) are replaced in one
        transaction that keeps the cut version for undo (core/chat/trash.py). Raises :class:`SessionError` when there is no such
        reply, or its ids are not the loaded model's (regenerate it instead)."""
        with self._lock:
            if reply_id is None:
                cid = self._cid()
                self._check_idle(cid)
                path = self.store.active_path(cid)
                if not path or path[-1].role != "assistant":
                    raise SessionError("nothing to continue: the active path ends in no reply")
                reply = path[-1]
            else:
                reply = self.store.get_node(reply_id)
                if reply.role != "assistant":
                    raise SessionError("only a reply can be continued")
                self._check_idle(reply.conversation_id)
            model = (reply.meta or {}).get("model")
            if not reply.token_ids or model != self.engine.model_name:
                raise SessionError(
                    "this reply's token ids are not the loaded model's: regenerate it instead"
                )
            user = self.store.get_node(reply.parent_id)
            return self._generate("continue", user, None, max_tokens, on_event, reply)

    def generate_after(
        self,
        node_id: int,
        *,
        regenerate: bool = False,
        max_tokens: int | None = None,
        on_event: EventCallback | None = None,
    ) -> TurnHandle:
        """Generate an assistant step under node ``node_id`` (a user message, or the last
        tool result of a round: the next step of a tool round, docs/DESIGN.md §12.1); the
        prompt is the path to it. ``regenerate``: a new sibling of the steps already
        there, sampled as a regenerate is (the swipe temperature). Raises
        :class:`SessionError` while the conversation has a turn in flight."""
        with self._lock:
            node = self.store.get_node(node_id)
            if node.role not in ("user", "tool"):
                raise SessionError("a step follows a user message or a tool result")
            self._check_idle(node.conversation_id)
            kind = "regenerate" if regenerate else "round"
            return self._generate(kind, node, None, max_tokens, on_event)

    def _check_idle(self, conversation_id: int | None) -> None:
        if self.in_flight(conversation_id) is not None:
            raise SessionError("a reply is still being generated")

    def _generate(
        self,
        kind: str,
        user: Node,
        restore: Node | None,
        max_tokens: int | None,
        on_event: EventCallback | None,
        continued: Node | None = None,
    ) -> TurnHandle:
        """Submit the prompt for the path ending at ``user`` (for a "continue", followed by
        the ids of the reply ``continued``). ``kind`` "send"/"edit" added ``user`` and
        remove it again on failure (reselecting ``restore``)."""
        added = kind in ("send", "edit")
        try:
            settings = self.settings(user.conversation_id)
            tools = self.tool_specs(settings)
            prompt = self.build_prompt(self.store.path_to(user.id), settings, tools)
            n_replies = len(self.store.replies(user.id))
            ids = prompt.token_ids + (tuple(continued.token_ids) if continued is not None else ())
            max_tokens = self._room(len(ids), max_tokens, settings)
        except Exception:
            if added:
                self._rollback(user, restore)
            raise
        turn = TurnHandle(kind, user, prompt, on_event)
        turn.continued = continued
        turn.tools = tools
        params = settings.sampling
        if kind == "regenerate" and params.greedy:
            params = dataclasses.replace(params, temperature=settings.swipe_temperature)
        if params.seed is not None and not params.greedy:
            # reply k of this message: a new sample, reproducibly
            params = dataclasses.replace(params, seed=(params.seed + n_replies) % SEED_LIMIT)
        params = dataclasses.replace(params, max_tokens=max_tokens)
        request = GenerateRequest(ids, params, prompt.boundaries, self.use_cache)
        turn.request = request

        def handle_event(event: Event) -> None:
            if isinstance(event, Stopping) and turn.cancelled:
                return  # the turn's own cancel() said it already: one Stopping per turn
            if isinstance(event, Finished):
                self._finished(turn, event, added, restore)
            elif isinstance(event, Failed) and added:
                self._safely(turn, lambda: self._rollback(user, restore))
            turn.emit(event)

        try:
            turn.attach(self.engine.submit(request, handle_event))
        except Exception:
            if added:
                self._rollback(user, restore)
            raise
        self.current = turn
        self._turns[user.conversation_id] = turn
        return turn

    def _room(
        self, prompt_tokens: int, max_tokens: int | None, settings: ConversationSettings
    ) -> int:
        """The reply's token budget: ``max_tokens`` of this call, else the conversation's
        (both the user's choice, so neither is cut silently), which must fit beside the
        prompt in the model's context. Raises :class:`ContextLimitError` before anything is
        submitted (docs/DESIGN.md §12)."""
        asked = max_tokens if max_tokens is not None else settings.sampling.max_tokens
        try:
            return generation_room(prompt_tokens, asked, context_length(self.engine), explicit=True)
        except ContextLimitExceeded as e:
            raise ContextLimitError(e) from None

    def _finished(self, turn: TurnHandle, event: Finished, added: bool, restore) -> None:
        metrics = event.metrics
        if metrics.finish_reason == "cancelled" and not event.token_ids:
            if added:
                self._safely(turn, lambda: self._rollback(turn.user_node, restore))
            return
        meta = dataclasses.asdict(metrics)
        meta["model"] = self.engine.model_name
        text, ids = event.text, event.token_ids
        old = turn.continued
        if old is not None:  # the whole reply, as one generation would have made it
            meta["continued"] = (old.meta or {}).get("continued", 0) + 1
            ids = tuple(old.token_ids or ()) + tuple(ids)
            text = old.content + text
            try:
                text = decode_ids(self.engine.tokenizer, ids, skip_special=True)
            except Exception:  # noqa: BLE001 -- keep the joined text
                pass
        if turn.tools:  # the whole reply's calls into meta (docs/DESIGN.md §12.1)
            fmt = ReplyFormat.of(self.engine.tokenizer)
            cut = metrics.finish_reason == "length"  # a call cut short is text until continued
            whole = text
            self._safely(turn, lambda: meta.update(reply_meta(fmt, whole, turn.tools, cut=cut)))
            text = meta.pop("content", text)

        def store() -> None:
            if old is not None:  # grown in place; the cut version kept for undo
                turn.reply_node = Trash(self.store).replace_reply(old, text, ids, meta)
                return
            turn.reply_node = self.store.add_node(
                turn.user_node.conversation_id,
                turn.user_node.id,
                "assistant",
                text,
                token_ids=ids,
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
