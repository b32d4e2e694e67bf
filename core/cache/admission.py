"""Which committed entries the SSD tier writes, and when: admission by reuse.

Writing every entry of every turn at once writes each token several times: a turn's prompt
tail and its sequence end hold the same last partial block, and the next turn's tail and
end hold it again, until the block fills (docs/DESIGN.md §8.6). Most of them are never read
back: the next turn continues from the resident cache. So an entry committed to the hot
tier is written to the SSD tier

- **at once** when it is likely to be read again by another conversation or needed to
  restore at all: a block of the system prompt, a message-boundary checkpoint (state
  models restore only at a snapshot);
- **when reused**: a restore read it from the hot tier, or a later prompt passed through it
  again (:meth:`WritePolicy.hit`): a block already hit, a conversation the user returns to,
  the same prompt regenerated;
- **when RAM lets it go** (a hot eviction) **or at close**, unless it is *covered*: a longer
  entry after the same block, on the SSD tier or about to be, starts with its tokens (a
  turn's prompt tail, covered by its own sequence end; a sequence end, covered by the next
  turn's). A covered entry is skipped, counted, never written; restores after a restart
  still find its tokens in the entry that covers it. The newest prompt tail that kept its
  first token's logprobs (§8.3) is never covered, so the last prompt regenerates after a
  restart with no forward. A sequence end whose prompt a newer entry answers again (a
  regenerated reply: :func:`replaced`) is skipped too: the prompt is kept by the newer one,
  only the old reply's tokens would be computed again if the user went back to it.

Deferred entries live in the hot tier meanwhile, for a bounded time: once an entry has
waited ``idle_s`` seconds since its commit (``ssd_flush_idle_s``) and the engine has been
quiet (no request held or waiting) for :data:`QUIET_S`, it is *due* (:meth:`WritePolicy.due`)
and decided as at close: written, or skipped when covered. A session that goes on within
the window covers its last turn's tails and is written as above; one that stops has its
entries on disk about ``idle_s`` later. The quiet keeps these writes out of busy rounds:
clients that send their next turn as a reply ends leave the engine idle for milliseconds,
and writes started there (a copy of the entry, then the file) slowed the next round's
prefills (16 clients on an H100: p90 TTFT 1.1-1.6 s against 0.6-0.8 s without, in one run;
docs/BENCHMARKS.md). Under a load that never pauses that long, an entry is due anyway once it
has waited :data:`MOST_WAITS` times ``idle_s``, at the engine's next idle moment. So a crash
(not a close) loses at most what was committed in the last ``idle_s`` seconds before a
pause (``MOST_WAITS x idle_s`` under constant load), and what the writer had queued, never
the blocks and checkpoints already written. Engine thread only; the clock is injectable
(:attr:`WritePolicy.clock`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from .blocks import KIND_BLOCK, KIND_BOUNDARY, KIND_SEQ, KIND_TAIL, Entry

QUIET_S = 1.0  # seconds with no request held or waiting before a deferred write is due
MOST_WAITS = 6  # ... or this many windows since its commit, whatever the load


def covers(c: Any, t: Any) -> bool:
    """Whether entry ``c`` (an ``Entry`` or the SSD tier's ``FileMeta``) holds every token
    of ``t`` after the same block, with at least the layers ``t`` carries: then a restore
    that would use ``t`` can use the first ``len(t.tokens)`` tokens of ``c``. An entry with
    a state snapshot is covered by none (a snapshot is valid only at its own position)."""
    n = len(t.tokens)
    return (
        c.id != t.id
        and not t.snapshot
        and c.parent == t.parent
        and c.start == t.start
        and len(c.tokens) > n
        and tuple(c.tokens[:n]) == tuple(t.tokens)
        and (c.window or not t.window)
    )


def replaced(c: Any, t: Entry) -> bool:
    """Whether ``c`` holds all of the prompt that sequence end ``t`` answered (after the
    same block): ``c`` is another reply to it (a regenerate) or continues a sibling."""
    p = t.prompt_end - t.start
    return (
        t.kind == KIND_SEQ
        and p > 0
        and c.id != t.id
        and not t.snapshot
        and c.parent == t.parent
        and c.start == t.start
        and len(c.tokens) >= p
        and tuple(c.tokens[:p]) == tuple(t.tokens[:p])
        and tuple(c.tokens[: len(t.tokens)]) != tuple(t.tokens)
    )


class WritePolicy:
    """Admission of committed entries to the SSD tier (see the module doc).

    ``children``: the entries (hot ``Entry`` or SSD ``FileMeta``) after a parent id, for
    :func:`covers`; ``enabled`` False admits every entry at once; ``idle_s``: seconds a
    deferred entry waits before it is due (:meth:`due`), on :attr:`clock` (seconds,
    monotonic). Counters: ``deferred`` entries waiting (and their bytes), ``skipped``
    entries dropped as covered (and their bytes of arrays), ``admitted`` entries handed
    to the SSD tier by reason.
    """

    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(
        self, children: Callable[[str], list[Any]], enabled: bool = True, idle_s: float = 5.0
    ) -> None:
        self._children = children
        self.enabled = enabled  # False: every entry is written at once (write-through)
        self.idle_s = idle_s
        self._deferred: dict[str, Entry] = {}  # commit order
        self._since: dict[str, float] = {}  # clock at the commit of each deferred entry
        self._order: dict[str, int] = {}  # commit order of the deferred entries
        self._seq = itertools.count()
        self.newest_prompt_tail: str | None = None
        self.skipped = self.skipped_bytes = 0
        self.admitted: dict[str, int] = dict.fromkeys(("now", "hit", "evicted", "idle", "close"), 0)

    @property
    def deferred(self) -> int:
        return len(self._deferred)

    @property
    def deferred_bytes(self) -> int:
        return sum(e.nbytes for e in self._deferred.values())

    def is_deferred(self, entry_id: str) -> bool:
        return entry_id in self._deferred

    def offer(self, e: Entry) -> bool:
        """A committed entry: True to write it at the next persist, False when deferred."""
        if e.kind == KIND_TAIL and e.logprobs:
            self.newest_prompt_tail = e.id
        urgent = (e.kind == KIND_BLOCK and e.role == "system") or e.kind == KIND_BOUNDARY
        if urgent or not self.enabled:
            self._pop(e.id)
            self.admitted["now"] += 1
            return True
        self._deferred[e.id] = e
        self._since.setdefault(e.id, self.clock())  # the window runs from the first commit
        self._order[e.id] = next(self._seq)
        return False

    def _due_at(self, since: float, quiet_for: float) -> float:
        """When an entry committed at ``since`` is due (clock seconds), the engine quiet
        for ``quiet_for`` seconds now (the quiet goes on while nothing arrives)."""
        window = since + self.idle_s
        quiet = self.clock() + max(0.0, QUIET_S - quiet_for)
        return min(max(window, quiet), since + MOST_WAITS * self.idle_s)

    def due_in(self, quiet_for: float = float("inf")) -> float | None:
        """Seconds until the oldest deferred entry is due (0.0: now) if the engine stays
        quiet (``quiet_for``: seconds with no request held or waiting so far), None when
        none waits."""
        for entry_id in self._since:  # commit order: the first is the oldest
            return max(0.0, self._due_at(self._since[entry_id], quiet_for) - self.clock())
        return None

    def due(self, max_bytes: int | None = None, quiet_for: float = float("inf")) -> list[Entry]:
        """The deferred entries due now (waited ``idle_s`` seconds with the engine quiet
        for :data:`QUIET_S`, or :data:`MOST_WAITS` windows; ``quiet_for`` as at
        :meth:`due_in`), in commit order, at most ``max_bytes`` of arrays (at least one
        entry), to write now; the covered ones are skipped (counted), as at :meth:`flush`."""
        now, keep, nbytes = self.clock(), [], 0
        for entry_id, since in list(self._since.items()):
            e = self._deferred[entry_id]
            if self._due_at(since, quiet_for) > now or (
                keep and max_bytes is not None and nbytes + e.nbytes > max_bytes
            ):
                break
            del self._deferred[entry_id], self._since[entry_id]
            if self._keep(e, "idle"):
                keep.append(e)
                nbytes += e.nbytes
            self._order.pop(entry_id, None)
        return keep

    def _pop(self, entry_id: str) -> Entry | None:
        self._order.pop(entry_id, None)
        self._since.pop(entry_id, None)
        return self._deferred.pop(entry_id, None)

    def hit(self, e: Entry) -> bool:
        """``e`` was reused (read by a restore, or passed through by a later prompt):
        True, it is to be written (a no-op for the SSD tier when it holds it already)."""
        if self._pop(e.id) is not None:
            self.admitted["hit"] += 1
        return True

    def evicted(self, e: Entry) -> bool:
        """The hot tier dropped ``e``: True to write it now (deferred and not covered)."""
        if self._deferred.pop(e.id, None) is None:
            return False
        self._since.pop(e.id, None)
        keep = self._keep(e, "evicted")
        self._order.pop(e.id, None)
        return keep

    def forget(self, entry_id: str) -> None:
        """``entry_id`` left the hot tier without being written (a clear, a bad entry)."""
        self._pop(entry_id)

    def flush(self) -> list[Entry]:
        """At close: the deferred entries to write, in commit order; the covered ones are
        skipped (counted)."""
        entries, self._deferred = list(self._deferred.values()), {}
        self._since.clear()
        keep = []
        for e in entries:
            # coverage is judged against what stays: entries skipped just before still
            # count (a longer one covers them in turn, and the longest is kept)
            if self._keep(e, "close"):
                keep.append(e)
        self._order.clear()
        return keep

    def _keep(self, e: Entry, reason: str) -> bool:
        order = self._order.get(e.id, -1)
        children = self._children(e.parent)
        gone = e.id != self.newest_prompt_tail and any(covers(c, e) for c in children)
        # a reply the user regenerated: a newer entry answers (or continues) its prompt
        gone = gone or any(replaced(c, e) and self._order.get(c.id, -1) > order for c in children)
        if gone:
            self.skipped += 1
            self.skipped_bytes += e.nbytes
            return False
        self.admitted[reason] += 1
        return True
