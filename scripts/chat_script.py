"""The scripted chat that ``exactness.py`` and ``hybrid_table.py`` replay (:data:`SCRIPT`,
:func:`play`), and mlx-lm's server flow they compare with (:func:`mlx_lm_prefill`).

An operation is a tuple; its first item names it (a ``restart+`` or ``clear_hot+`` prefix
restarts the engine or clears its hot tier first)::

    ("user", TEXT)                      send TEXT
    ("regenerate",)                     a new reply to the last user message
    ("swipe+user", TURN, INDEX, TEXT)   select reply INDEX of user turn TURN, then send
    ("edit", TURN, TEXT)                replace user turn TURN by TEXT (a new branch)
    ("edit_last", TEXT)                 the same for the last user turn
    ("restart+user", TEXT)              a new engine (hot tier, tails gone; SSD kept), send
    ("clear_hot+user", TEXT)            clear the hot tier, send
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
import tierchat.core  # noqa: F401  (OpenBLAS before mlx)
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from tierchat.core.api import Finished
from tierchat.core.chat.session import ChatSession, TurnHandle
from tierchat.core.engine.engine import Engine

SYSTEM = "You are a careful assistant. Answer briefly, and keep every answer short please."
USERS = [
    "Describe the tides, the moon and the wind over the harbour at dusk, in detail.",
    "Now compare that with a mountain lake in winter, in two or three sentences.",
    "Which of the two would a painter choose, and why would they choose it?",
    "Summarise everything so far as a short list of three items, one line each.",
]

SCRIPT = [
    ("user", USERS[0]),
    ("user", USERS[1]),
    ("regenerate",),
    ("regenerate",),
    ("swipe+user", 1, 0, USERS[2]),
    ("edit", 0, USERS[3]),
    ("user", USERS[1]),
    ("edit_last", USERS[2]),
    ("restart+user", USERS[0]),
    ("clear_hot+user", USERS[3]),
    ("regenerate",),
]


def play(
    session: ChatSession,
    script: Sequence[tuple],
    restart: Callable[[], Engine],
    timeout: float = 600.0,
) -> Iterator[tuple[str, TurnHandle, Finished]]:
    """Run ``script`` through ``session``: ``(name, turn, finished)`` per operation.

    ``restart`` makes the engine that replaces ``session.engine`` (closed first).

    Raises:
        RuntimeError: an operation did not finish with a reply (its event is named).
    """
    for op in script:
        name = op[0]
        if name.startswith("restart"):
            session.engine.close()
            session.engine = restart()
        if name.startswith("clear_hot"):
            session.engine.clear("hot")
        if name.startswith("swipe"):
            session.swipe(op[1], op[2])
        if name == "regenerate":
            turn = session.regenerate()
        elif name == "edit":
            turn = session.edit(op[1], op[2])
        elif name == "edit_last":
            turn = session.edit(len(session.user_turns()) - 1, op[1])
        else:
            turn = session.send(op[-1])
        result = turn.wait(timeout)
        if not isinstance(result, Finished):
            raise RuntimeError(f"{name}: {result!r}")
        yield name, turn, result


def mlx_lm_prefill(lru, model, prompt: list[int], boundaries) -> tuple[list, int]:
    """``mlx_lm/server.py``'s flow up to decode: the nearest cached prefix (an exact entry is
    trimmed by one token, or dropped when it cannot be), then a prefill up to the last
    token in steps of 2048 (its ``prefill_step_size``), inserting a checkpoint at the end
    of every system/user segment. Returns the cache and the number of tokens reused."""
    cache, rest = lru.fetch_nearest_cache("m", prompt)
    start = len(prompt) - len(rest)
    if cache is None:
        cache, start = make_prompt_cache(model), 0
    if start == len(prompt):  # exact entry: the last token must be fed again
        if can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, 1)
            start -= 1
        else:
            cache, start = make_prompt_cache(model), 0
    roles = dict(boundaries)
    ends = sorted(
        e for e, role in roles.items() if role in ("system", "user") and start < e < len(prompt) - 1
    )
    pos = start
    for end in ends + [len(prompt) - 1]:
        while end > pos:
            step = min(2048, end - pos)
            model(mx.array(prompt[pos : pos + step])[None], cache=cache)
            mx.eval([c.state for c in cache])
            pos += step
        if end in ends:
            lru.insert_cache("m", prompt[:end], copy.deepcopy(cache), cache_type=roles[end])
    return cache, start
