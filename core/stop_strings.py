"""Stop strings: where a growing reply text ends (docs/DESIGN.md §2 "Sampling").

Pure Python. The engine's executor feeds it each decoded token's text (through a
request's ``Decoding``, ``core/engine/request.py``); it is the one stop-string matcher
(the chat's requests and serve's carry their ``stop`` to the engine).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopStrings"]


class StopStrings:
    """Finds the first stop string in a growing reply text. :meth:`feed` takes the whole
    text so far and returns ``(text safe to show, stopped)``: on a stop, the text before
    it (and :attr:`matched` names the stop string); else the text minus a tail that could
    still begin a stop string. The text is searched from where the last call's search
    could not yet have found a stop, so a long reply is scanned once, not once a token."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._searched = 0  # a stop string ends past this offset (the text only grows)
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        # (a few characters more: a detokenizer may still rewrite the text's last ones)
        start = max(0, self._searched - self._hold - 8)
        hits = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
        if hits:
            cut, self.matched = min(hits)
            return text[:cut], True
        self._searched = len(text)
        keep = len(text)
        for k in range(min(self._hold, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stops):
                keep = len(text) - k
                break
        return text[:keep], False
