"""Reading keys from a terminal: Textual's xterm parser, with the Alt keys it loses.

Terminals send Alt+key in two ways: xterm's modifier form (``ESC [1;3C`` for Alt+→) and
the older ESC prefix (ESC, then the key's own bytes: ``ESC ESC [C``, ``ESC CR``), which
macOS Terminal, iTerm2 in its default profile and others send. Textual 8's
``XTermParser`` reads the first form and the prefix before a printable character
(``ESC x`` is Alt+X), but not the prefix before a key that has a sequence or a name of
its own:

- ``ESC ESC [C``: a second ESC makes the parser send the first as the Escape key
  (``send_sequence(process_alt=False)`` in ``textual/_xterm_parser.py``), so Alt+→
  arrives as Esc then →: it stops a reply instead of swiping.
- ``ESC CR``: the ESC prefix becomes ``alt``, but a key found in ``ANSI_SEQUENCES_KEYS``
  as a tuple is sent without it, so Alt+Enter arrives as Enter and sends the message.

:class:`AltPrefixParser` reads both as Alt keys. The rule is the terminal convention for
an ESC prefix (readline, vim and crossterm's PR #1124 read it so): an ESC followed,
within the escape delay, by a key is that key with Alt. An Escape the parser sent only
because its delay ran out (a real Esc key press) is never combined with what follows.
:class:`TierchatDriver` is Textual's ``LinuxDriver`` reading with it (Linux and macOS).
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Iterable
from typing import Any

from textual import events
from textual._parser import Peek1, Read1, TokenCallback
from textual._xterm_parser import XTermParser
from textual.driver import Driver
from textual.drivers import linux_driver
from textual.message import Message


class AltPrefixParser(XTermParser):
    """``XTermParser`` that reads ``ESC`` + a named key as Alt+that key.

    ``ESC ESC [C`` (or ``ESC ESC OC``) gives ``alt+right``, likewise for the other keys a
    sequence names (arrows, Home, End, Delete, F-keys); ``ESC CR`` gives ``alt+enter``,
    ``ESC TAB`` ``alt+tab``. Everything else is parsed as ``XTermParser`` parses it.
    """

    def __init__(self, debug: bool = False) -> None:
        self._held: events.Key | None = None  # an Escape sent because another ESC came
        self._ticking = False  # inside tick(): tokens sent because a delay ran out
        super().__init__(debug)

    def parse(self, token_callback: TokenCallback) -> Generator[Read1 | Peek1, str, None]:
        return super().parse(self._combining(token_callback))

    def _combining(self, send: Callable[[Message], None]) -> Callable[[Message], None]:
        def on_token(token: Message) -> None:
            held, self._held = self._held, None
            if held is not None:
                if _named_key(token):
                    send(events.Key(f"alt+{token.key}", None))  # type: ignore[attr-defined]
                    return
                send(held)
            if isinstance(token, events.Key) and token.key == "escape" and not self._ticking:
                # The parser sends Escape outside tick() only when a second ESC follows
                # it at once: keep it until the key that ESC starts is known.
                self._held = token
                return
            send(token)

        return on_token

    def tick(self) -> Iterable[Message]:
        self._ticking = True
        try:
            yield from super().tick()
        finally:
            self._ticking = False

    def feed(self, data: str) -> Iterable[Message]:
        yield from super().feed(data)
        if not data and self._held is not None:  # end of input: nothing follows the ESC
            held, self._held = self._held, None
            yield held

    def _sequence_to_key_events(self, sequence: str, alt: bool = False) -> Iterable[events.Key]:
        for key in super()._sequence_to_key_events(sequence, alt):
            if alt and len(sequence) == 1 and _named_key(key):
                # ESC + a control character with a key name (CR: enter, TAB: tab).
                yield events.Key(f"alt+{key.key}", None)
            else:
                yield key


def _named_key(token: Message) -> bool:
    """A key with a name and no modifier that is not text (→, enter, f5; not "a", "escape")."""
    if not isinstance(token, events.Key):
        return False
    key = token.key
    return "+" not in key and key != "escape" and not token.is_printable and len(key) > 1


class TierchatDriver(linux_driver.LinuxDriver):
    """Textual's ``LinuxDriver``, reading keys with :class:`AltPrefixParser`."""

    def run_input_thread(self) -> None:
        # LinuxDriver builds its parser inside this loop (``XTermParser(self._debug)``);
        # run that very loop with the parser name bound to ours instead of copying it.
        loop = linux_driver.LinuxDriver.run_input_thread
        names = {**vars(linux_driver), "XTermParser": AltPrefixParser}
        types.FunctionType(loop.__code__, names, loop.__name__)(self)


def driver_class(default: type[Driver]) -> type[Driver]:
    """:class:`TierchatDriver` where Textual would use its ``LinuxDriver`` (and builds the
    parser there by name, as Textual 8 does); ``default`` otherwise (Windows, a driver
    named by ``TEXTUAL_DRIVER``)."""
    builds_by_name = "XTermParser" in linux_driver.LinuxDriver.run_input_thread.__code__.co_names
    if default is linux_driver.LinuxDriver and builds_by_name:
        return TierchatDriver
    return default


class KeyOrder:
    """The terminal's keys reach the widgets one at a time, in the order typed.

    Textual forwards a key to the focused widget's queue and runs a non-priority binding
    (Backspace in an ``Input``, a screen's ↓) only when the key comes back up to the app
    unhandled; a text key is handled on the way down. Keys that reach the app together
    (typed while it was busy: a reply ending re-lists the conversations) were applied out
    of order: "⌫⌫⌫⌫400" typed into an F9 field saved "00" or "0", each Backspace running
    after the digits. Here the app holds each key until the one before it has gone
    through: after forwarding a key it posts :class:`~tierchat.tui.messages.KeyHandled`
    behind it to the same widget, which bubbles up the path the key takes, so it reaches
    the app after the key's own binding ran. A key whose widget goes away meanwhile (the
    message is dropped) is released after :attr:`RELEASE_S`.
    """

    RELEASE_S = 0.25

    def __init__(self, app: Any, dispatch: Callable[[Any], Awaitable[None]]) -> None:
        self.app = app
        self.dispatch = dispatch  # Textual's own key handling (App.on_event)
        self.held: deque = deque()
        self.seq = 0  # the key in flight (0: none)
        self._count = 0
        self._timer: Any = None

    async def arrived(self, event: events.Key) -> None:
        """A key from the terminal: handled now, or after the keys before it."""
        if self.seq:
            self.held.append(event)
            return
        await self._send(event)

    async def handled(self, seq: int) -> None:
        """Key ``seq`` went through (stale numbers are ignored): send the next one held."""
        if seq != self.seq:
            return
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self.seq = 0
        while self.held and not self.seq:
            await self._send(self.held.popleft())

    async def _send(self, event: events.Key) -> None:
        from tierchat.tui.messages import KeyHandled  # messages imports nothing of ours

        self._count += 1
        seq = self.seq = self._count
        target = self.app.focused or self.app.screen
        await self.dispatch(event)
        if self.seq != seq:
            return
        target.post_message(KeyHandled(seq))
        self._timer = self.app.set_timer(self.RELEASE_S, lambda: self.handled(seq))
