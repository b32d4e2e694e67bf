"""The value types of a restore: where an entry is held (:class:`Held`), the resident
cache (:class:`Resident`), a plan (:class:`Plan`) and what a restore put back
(:class:`Restored`). docs/DESIGN.md §9.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..api import (
    CACHE_KINDS,
    CACHE_SOURCES,
)
from .blocks import EntryMeta
from .rates import Choice


class Held(NamedTuple):
    """Where an entry is held and what it carries."""

    source: str  # "hot" | "ssd"
    window: bool  # every window leaf's slice is present
    snapshot: bool  # every state leaf's snapshot (at the entry's end) is present


@dataclass
class Resident:
    """The live cache of the last request and the tokens it holds (``len(tokens)`` is
    every leaf's position). Reused in place by the next request when it shares a prefix."""

    tokens: tuple[int, ...]
    caches: list[Any]
    nbytes: int = 0
    # the request's prompt length and the logprobs its first token was sampled from
    # (shape (vocab,)): what a forward of the prompt's last token gives again
    prompt_tokens: int = 0
    first_logprobs: Any = None
    # the logprobs after its last token (shape (vocab,)): a continue of the reply, whose
    # prompt is all of ``tokens``, samples its first token from them (no forward)
    end_logprobs: Any = None


@dataclass
class Restored:
    """What a restore put into the cache: ``position`` tokens, split by tier (``cached_by``)
    and by entry kind (``cached_kind``), and the cache list to continue with."""

    position: int = 0
    cached_by: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHE_SOURCES, 0))
    cached_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHE_KINDS, 0))
    nbytes: int = 0  # bytes copied into the cache (0 when the resident cache was cut)
    caches: list[Any] | None = None
    first_logprobs: Any = None  # set when position == the whole prompt (restore_repeat)
    choice: Choice | None = None  # SSD read or recompute, when the rates chose (.rates)
    ssd_bytes: int = 0  # bytes of SSD files read


@dataclass
class Plan:
    """A restore at ``position``: leaves in ``cut`` from the resident cache, the others
    from ``blocks`` (chain indices) and ``tail`` (an entry after block ``position // bs``,
    of which the first ``tail_tokens`` are used). ``kept``: the prompt tail whose kept
    logprobs give the first token, when ``position`` is the whole prompt (it is ``tail``
    too, unless every leaf is cut from the resident cache)."""

    position: int
    cut: frozenset[str] = frozenset()
    blocks: tuple[int, ...] = ()
    tail: EntryMeta | None = None
    tail_tokens: int = 0
    kept: EntryMeta | None = None

    def entry_ids(self) -> list[str]:
        """The ids of the entries after the chain's blocks: the tail, and the kept
        logprobs' tail where that is another entry."""
        return list(dict.fromkeys(t.id for t in (self.tail, self.kept) if t is not None))
