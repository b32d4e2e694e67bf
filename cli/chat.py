"""``tierchat chat``: line-mode chat in a plain terminal, on the same engine and cache.

Type a message and press Enter; the reply streams, then one line says what the turn cost
(cached / prefilled tokens, TTFT, decode speed). Commands::

    /regen [TURN]        a new reply to user turn TURN (default the last; a sibling)
    /swipe TURN INDEX    show reply INDEX of user turn TURN (0-based; negative from the end)
    /edit TURN TEXT      replace user turn TURN by TEXT as a new branch and answer it
    /continue            more of the last reply (one cut at --max-tokens): nothing prefilled
    /set [KEY VALUE]     this conversation's settings, or set one: temperature, top_p,
                         top_k, min_p, repetition_penalty, presence_penalty,
                         frequency_penalty, repetition_context_size, stop (a|b),
                         max_tokens, seed, swipe_temperature, system
    /new [SYSTEM]        start a new conversation (optionally with a system prompt)
    /tools [on|off NAME] the MCP servers and their tools; enable or disable one here
    /stats               the cache tiers in one line each
    /help                this list
    /quit                leave (so does end of input, Ctrl-D)

Ctrl-C during a reply cancels it (what was generated is kept); at the prompt it clears the
line. Conversations are stored in the conversation store (``--data-dir``).

Tools (docs/DESIGN.md §12.1): with MCP servers in ``mcp.json`` (or ``--mcp-config``), a new
conversation has every server's tools. A reply that calls a tool asks first, one line per
call: ``y`` runs it once, ``a`` runs it and this tool from then on in the conversation,
``n`` denies it (then a reason, sent to the model); Ctrl-C during a call cancels it. The
next step then runs by itself, up to ``tool_rounds`` steps with calls per answer. A call's
markup is not printed as it streams: the call prints as a ``[tool call: …]`` line.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tierchat.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    CLIError,
    SSDWatch,
    check_cache_owner,
    new_session,
    open_store,
    start_engine,
)
from tierchat.core.text import printable
from tierchat.core.units import fmt_bytes, fmt_seconds

HELP = __doc__.split("::", 1)[1].split("\n\nCtrl-C", 1)[0].strip("\n")


def metrics_line(m: Any) -> str:
    """One line of turn metrics: ``[cached 768/812 (hot 512, tail 256) · prefilled 44 · ...]``."""
    parts = [f"{k} {v}" for k, v in {**m.cached_by, **m.cached_kind}.items() if v]
    by = f" ({', '.join(parts)})" if parts else ""
    text = (
        f"[cached {m.cached_tokens}/{m.prompt_tokens}{by} · prefilled {m.prefill_tokens}"
        f" · TTFT {fmt_seconds(m.ttft_s)} · {m.generation_tokens} tokens at {m.generation_tps:.1f} tok/s"
    )
    if m.finish_reason != "stop":
        text += f" · {m.finish_reason}"
    return text + "]"


class LineChat:
    """The read-eval-print loop over a :class:`~tierchat.core.chat.session.ChatSession`."""

    def __init__(
        self, session: Any, inp: TextIO, out: TextIO, err: TextIO, rounds: Any = None
    ) -> None:
        self.session = session
        self.rounds = rounds  # ToolRounds, None without MCP servers
        self.inp = inp
        self.out = out
        self.err = err
        self.prompt = "you> " if inp.isatty() else ""
        self.ssd_watch = SSDWatch(session.engine)

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def read(self) -> str | None:
        """One input line; None at end of input. Ctrl-C at the prompt gives ``""``."""
        try:
            if self.inp is sys.stdin:
                return input(self.prompt)
            line = self.inp.readline()
            return line.rstrip("\n") if line else None
        except EOFError:
            return None
        except KeyboardInterrupt:
            self.say()
            return ""

    def loop(self) -> None:
        while True:
            line = self.read()
            if line is None:
                return
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
            else:
                self.stream(lambda text=line: self.session.send(text))
            self.ssd_watch.check(self.err)

    def stream(self, start) -> Any:
        """Start a turn with ``start()``, print it, then run its tool rounds; returns the
        last turn (None when none started)."""
        turn = self.stream_turn(start)
        while self.rounds is not None and turn is not None and turn.reply_node is not None:
            turn = self.tool_round(turn.reply_node)
        return turn

    def tool_round(self, reply: Any) -> Any:
        """Answer ``reply``'s calls and generate the next step; None when there is none."""
        from tierchat.core.chat.tool_rounds import call_summary

        state = self.rounds.state(reply)
        if state is None or not state.calls:
            return None
        for call in state.calls:
            self.say(f"[tool call: {printable(call_summary(call))}]")
        if state.step == "limit":
            self.say(f"[the limit of {self.rounds.max_rounds} tool rounds is reached: not run]")
        go = self.rounds.resolve(state, self.approve, wait=self.wait_call, on_result=self.result)
        if not go:
            return None
        return self.stream_turn(lambda: self.rounds.next_round(state))

    def approve(self, call: Any) -> Any:
        """The ``y/n/a`` question for ``call``; end of input denies."""
        from tierchat.core.chat.tool_rounds import Decision, call_summary

        while True:
            self.out.write(f"run {printable(call_summary(call))}? [y]es once, [n]o, [a]lways: ")
            self.out.flush()
            line = self.read()
            if line is None:
                return Decision("deny")
            answer = line.strip().lower()
            if answer in ("n", "no"):
                self.out.write("reason (optional): ")
                self.out.flush()
                return Decision("deny", (self.read() or "").strip())
            if answer in ("y", "yes"):
                return Decision("once")
            if answer in ("a", "always"):
                return Decision("always")

    def wait_call(self, handle: Any) -> Any:
        """A call's result; Ctrl-C cancels it."""
        try:
            return handle.result()
        except KeyboardInterrupt:
            handle.cancel()
            return handle.result()

    def result(self, call: Any, node: Any) -> None:
        meta = node.meta or {}
        kind = "cancelled" if meta.get("cancelled") else "denied" if meta.get("denied") else None
        kind = kind or ("error" if meta.get("is_error") else "ok")
        first = node.content.strip().splitlines()[0] if node.content.strip() else ""
        lines = node.content.count("\n") + 1
        more = f" (+{lines - 1} lines)" if lines > 1 else ""
        self.say(f"[tool {printable(call.display)} → {kind}: {printable(first[:160])}{more}]")

    def command(self, line: str) -> bool:
        """Run a /command; False to quit."""
        from tierchat.core.chat.session import SessionError
        from tierchat.core.chat.sqlite import StoreError

        name, _, rest = line.partition(" ")
        try:
            if name in ("/quit", "/exit", "/q"):
                return False
            if name == "/help":
                self.say(HELP)
            elif name in ("/regen", "/regenerate"):
                turn = int(rest) if rest.strip() else None
                self.stream(lambda: self.session.regenerate(turn=turn))
            elif name == "/swipe":
                turn, index = (int(x) for x in rest.split())
                reply = self.session.swipe(turn, index)
                i, n = self.session.selected_reply(turn)
                self.say(f"[turn {turn}: reply {i + 1} of {n}]")
                self.say(f"assistant> {printable(reply.content)}")
            elif name == "/edit":
                turn_text, _, text = rest.strip().partition(" ")
                turn = int(turn_text)
                if not text.strip():
                    raise ValueError("no text")
                self.stream(lambda: self.session.edit(turn, text.strip()))
            elif name == "/continue":
                self.stream(self.session.continue_reply)
            elif name == "/set":
                self.set_setting(rest.strip())
            elif name == "/new":
                self.session.new_conversation(system=rest.strip() or None)
                self.say("[new conversation]")
            elif name == "/stats":
                self.say(stats_lines(self.session.engine.stats()))
            elif name == "/tools":
                self.tools_command(rest.strip())
            else:
                self.say(f"unknown command {name}; /help lists them")
        except (SessionError, StoreError) as e:
            print(f"error: {printable(str(e))}", file=self.err, flush=True)
        except ValueError as e:
            if name in ("/set", "/tools") and str(e):
                print(f"error: {printable(str(e))}", file=self.err, flush=True)
                return True
            usage = {
                "/swipe": "/swipe TURN INDEX",
                "/edit": "/edit TURN TEXT",
                "/regen": "/regen [TURN]",
                "/set": "/set KEY VALUE (a number; stop: a|b; seed: empty for none)",
                "/tools": "/tools [on|off NAME]",
            }.get(name, name)
            print(f"error: usage: {usage}", file=self.err, flush=True)
        return True

    def set_setting(self, rest: str) -> None:
        """``/set``: show the conversation's settings; ``/set KEY VALUE``: change one.
        Raises ``ValueError`` with a message for the user (an unknown key, a value that
        is not a number or out of range) or :class:`SessionError` (no conversation)."""
        settings = self.session.settings()
        if not rest:
            for key, value in settings.to_dict().items():
                if key not in TOOL_SETTINGS:
                    self.say(f"[{key} = {printable(plain_value(value))}]")
            return
        key, _, value = rest.partition(" ")
        if key in TOOL_SETTINGS:
            raise ValueError(f"{key} is set with /tools")
        if key not in settings.to_dict():
            raise ValueError(f"unknown setting {key}; /set lists them")
        parsed = parse_setting(key, value.strip())
        changed = settings.with_values({key: parsed})  # a SamplingError names the field
        if self.session.conversation_id is None:
            self.session.new_conversation()
        self.session.save_settings(changed)
        self.say(f"[{key} = {printable(plain_value(parsed))}]")

    def tools_command(self, rest: str) -> None:
        """``/tools``: servers (state, enabled here) and tools; ``/tools on|off NAME``."""
        if self.rounds is None or self.rounds.host is None:
            self.say("[no MCP servers: add them to mcp.json in the config dir, or --mcp-config]")
            return
        if rest:
            verb, _, name = rest.partition(" ")
            if verb not in ("on", "off") or not name.strip():
                raise ValueError("")
            enabled = list(self.session.settings().tools)
            name = name.strip()
            enabled = [*enabled, name] if verb == "on" else [s for s in enabled if s != name]
            try:
                self.rounds.set_servers(enabled)
            except KeyError as e:
                raise ValueError(str(e.args[0])) from None
        enabled = set(self.session.settings().tools)
        for status in self.rounds.host.status():
            on = "on " if status.name in enabled else "off"
            self.say(f"[{on} {status.name} ({status.transport}, {status.state})]")
            if status.error:
                for line in status.error.splitlines():
                    self.say(f"      {printable(line)}")
            for tool in status.tools:
                desc = " ".join(tool.description.split())[:80]
                self.say(f"      {printable(tool.display)}: {printable(desc)}")

    def stream_turn(self, start) -> Any:
        """Start a turn with ``start()`` and print its reply as it streams; returns it
        (None when it did not start)."""
        from tierchat.core.api import Failed, Finished, Stopping, TokenBatch
        from tierchat.core.chat.session import SessionError
        from tierchat.core.chat.sqlite import StoreError

        try:
            turn = start()
        except StoreError as e:  # the turn could not be saved: say why, go on
            print(f"error: turn not saved: {printable(str(e))}", file=self.err, flush=True)
            return None
        except SessionError as e:  # e.g. a prompt past the context: nothing was sent
            print(f"error: {printable(str(e))}", file=self.err, flush=True)
            return None
        self.out.write("assistant> ")
        self.out.flush()
        shown = self.visible_text(turn)
        events = turn.events()
        while True:
            try:
                for event in events:
                    if isinstance(event, TokenBatch):
                        self.out.write(printable(shown(event.text)))
                        self.out.flush()
                    elif isinstance(event, Stopping):  # Ctrl+C: ends at the next step
                        self.out.write(" [stopping…]")
                        self.out.flush()
                    elif isinstance(event, Finished):
                        self.out.write(printable(shown(None)))
                        self.say()
                        self.say(metrics_line(event.metrics))
                    elif isinstance(event, Failed):
                        self.out.write(printable(shown(None)))
                        self.say()
                        print(f"error: {printable(event.message)}", file=self.err, flush=True)
                if turn.error is not None:
                    msg = printable(str(turn.error))
                    print(f"error: reply not saved: {msg}", file=self.err, flush=True)
                return turn
            except KeyboardInterrupt:
                turn.cancel()
                events = turn.events()

    def visible_text(self, turn: Any) -> Any:
        """``shown(delta)``: the text of a streamed ``delta`` to print, its tool calls held
        back (the round prints each as a ``[tool call: …]`` line); ``shown(None)`` at the
        end gives the text still held (a bare ``{…}`` that was no call).
        :class:`~tierchat.core.chat.tool_calls.HeldCalls`: reasoning prints as it
        streams; a continue's parser has read the reply so far."""
        from tierchat.core.chat.tool_calls import HeldCalls

        held = HeldCalls.for_turn(self.session.engine, turn)
        if held is None:
            return lambda delta: delta or ""
        return lambda delta: held.feed(delta) if delta is not None else held.finish()


INT_SETTINGS = ("top_k", "max_tokens", "repetition_context_size")
TOOL_SETTINGS = ("tools", "allowed_tools")  # /tools sets them, /set shows neither


def parse_setting(key: str, value: str) -> object:
    """The typed value of ``/set KEY VALUE``: ``stop`` is ``a|b`` (``\\n`` a line break),
    ``seed`` an integer or empty/``none`` for none, ``top_k`` and ``max_tokens``
    integers, ``system`` text, the rest numbers. Raises ``ValueError`` saying what
    ``key`` takes (ranges are checked when the settings are saved)."""
    if key == "stop":
        return tuple(p.replace("\\n", "\n") for p in value.split("|") if p)
    if key == "system":
        return value
    try:
        if key == "seed":
            return None if value.lower() in ("", "none") else int(value)
        if key in INT_SETTINGS:
            return int(value)
        return float(value)
    except ValueError:
        kind = "a number"
        if key in INT_SETTINGS:
            kind = "an integer"
        elif key == "seed":
            kind = "an integer, or none"
        got = f'not "{value}"' if value else "none given"
        raise ValueError(f"{key} takes {kind} ({got})") from None


def plain_value(value: object) -> str:
    """A setting as ``/set`` echoes it, in the form it is typed: ``0.8``, ``512``,
    ``none`` (no seed), ``a|b`` (stop strings), the system prompt's text; ``(none)`` for
    no stop strings or no system prompt."""
    if value is None:
        return "none"
    if value in ("", (), []):
        return "(none)"
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    if isinstance(value, (list, tuple)):
        return "|".join(str(v).replace("\n", "\\n") for v in value)
    return str(value)


def stats_lines(stats: Any) -> str:
    if not stats.enabled:
        return f"[cache off{': ' + stats.reason if stats.reason else ''}]"
    h, s, t, lk = stats.hot, stats.ssd, stats.tails, stats.lookups
    return "\n".join(
        [
            f"[turns {lk.lookups}: hit rate {lk.hit_rate:.0%}, {lk.cold} cold; resident"
            f" {lk.resident}, hot {lk.hot}, ssd {lk.ssd}, via tail {lk.tail}]",
            f"[hot  {h.entries} entries, {fmt_bytes(h.nbytes)} of {fmt_bytes(h.max_bytes)},"
            f" {h.hits} entries used, {h.evictions} evictions]",
            f"[ssd  {s.entries} files, {fmt_bytes(s.nbytes)} of {fmt_bytes(s.max_bytes)},"
            f" {s.hits} read{'' if s.enabled else ', off: ' + s.reason}]",
            f"[tails {t.entries} entries, {t.hits} hits, {t.checkpoint_hits} checkpoint hits]",
        ]
    )


def run_chat(
    settings: Any,
    *,
    system: str | None = None,
    inp: TextIO | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``tierchat chat``. Returns the exit code."""
    inp, out, err = inp or sys.stdin, out or sys.stdout, err or sys.stderr
    if hasattr(inp, "reconfigure"):  # bytes that are not UTF-8 become U+FFFD, not an exit
        inp.reconfigure(errors="replace")
    from tierchat.core.live_status import StatusService

    check_cache_owner(settings)
    host = start_tools(settings, err)
    try:
        store = open_store(settings.db_path, settings.store_busy_s)
        try:
            engine = start_engine(settings)
            try:
                session = new_session(engine, store, settings)
                rounds = tool_rounds(session, host, settings)
                session.new_conversation(system=system)
                if inp.isatty():
                    print(
                        f"tierchat chat with {settings.model} — /help for commands, Ctrl-D to quit",
                        file=out,
                        flush=True,
                    )
                # `tierchat cache stats|clear` in another shell talk to this engine
                with StatusService(engine, settings.cache_dir, "chat"):
                    LineChat(session, inp, out, err, rounds).loop()
            finally:
                engine.close()
        finally:
            store.close()
    finally:
        if host is not None:
            host.close()
    return EXIT_OK


def start_tools(settings: Any, err: TextIO) -> Any:
    """An :class:`~tierchat.core.tools.mcp_host.McpHost` with the servers of
    ``settings.mcp_path`` started (None when there are none); a server that fails is
    said on ``err`` and the chat goes on without it. Raises :class:`CLIError` (exit 2) for
    a malformed file."""
    from tierchat.core.tools.config import McpConfigError, load_servers
    from tierchat.core.tools.mcp_host import McpHost

    try:
        servers = load_servers(settings.mcp_path, explicit=settings.mcp_config is not None)
    except McpConfigError as e:
        raise CLIError(str(e), EXIT_USAGE) from None
    if not servers:
        return None
    host = McpHost(servers)
    host.start()
    for status in host.wait_ready():
        if status.state != "ready":
            print(f"warning: MCP server {printable(status.error)}", file=err, flush=True)
    return host


def tool_rounds(session: Any, host: Any, settings: Any) -> Any:
    """The session's :class:`~tierchat.core.chat.tool_rounds.ToolRounds` (None without
    servers); a new conversation gets every ready server's tools."""
    if host is None:
        return None
    from tierchat.core.chat.tool_rounds import ToolRounds

    return ToolRounds.from_settings(session, host, settings)
