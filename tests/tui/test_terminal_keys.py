"""Keys as a terminal sends them: the real app in a pseudo-terminal, typed as bytes.

Pilot presses key *names*, which skips the terminal's encoding (``ESC f`` is what Alt+F
sends, and Textual reads it as ctrl+right) and the order in which a burst of keys reaches
the widgets (text + Enter in one read). Here ``tests/tui/fake_app.py`` -- the real app,
store and key handling over the fake engine -- runs in a pty (Python's ``pty``: no tmux,
no screen scraping) at 100×30, and the test writes the bytes an xterm-256color terminal
(tmux included) sends. The app appends every action a key runs to a trace file; the test
waits for the action each key must run, and checks effects in the SQLite store.

``test_every_binding_in_the_help_is_typed`` fails when a binding is added without a step
here: every ``(binding id, key)`` the help lists must be typed once.

:class:`TmuxTerminal` runs the same app in a tmux pane (its own server socket) where a
test must also read the screen (``capture-pane``): what the transcript shows.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shlex
import shutil
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from tierchat.core.live_status import STATUS_FILE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT_S = 15.0

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a pty")

# What an xterm-256color terminal (and tmux, which speaks it) sends for each key.
KEY_BYTES: dict[str, bytes] = {
    "escape": b"\x1b",
    "enter": b"\r",
    "ctrl+j": b"\n",
    "shift+enter": b"\x1b[13;2u",  # kitty keyboard protocol; plain xterm sends \r
    "alt+enter": b"\x1b\r",  # the ESC prefix: xterm (metaSendsEscape), tmux, iTerm2
    "tab": b"\t",
    "up": b"\x1b[A",
    "down": b"\x1b[B",
    "right": b"\x1b[C",
    "left": b"\x1b[D",
    "home": b"\x1b[H",
    "end": b"\x1b[F",
    "delete": b"\x1b[3~",
    "alt+up": b"\x1b[1;3A",
    "alt+down": b"\x1b[1;3B",
    "alt+right": b"\x1b[1;3C",
    "alt+left": b"\x1b[1;3D",
    "alt+c": b"\x1bc",  # the ESC prefix, as tmux and xterm (metaSendsEscape) send it
    "f1": b"\x1bOP",
    "f2": b"\x1bOQ",
    "f3": b"\x1bOR",
    "f4": b"\x1bOS",
    "f5": b"\x1b[15~",
    "f6": b"\x1b[17~",
    "f7": b"\x1b[18~",
    "f8": b"\x1b[19~",
    "f9": b"\x1b[20~",
}


def key_bytes(key: str) -> bytes:
    if key in KEY_BYTES:
        return KEY_BYTES[key]
    if key.startswith("ctrl+") and len(key) == 6:
        return bytes([ord(key[-1]) - ord("a") + 1])
    if len(key) == 1:
        return key.encode()
    raise KeyError(f"no terminal bytes for {key!r}")


def help_bindings() -> dict[tuple[str, str], str]:
    """``(binding id, key) -> action`` for every key the help lists (default keymap)."""
    from tierchat.tui.app import BINDING_OWNERS

    out = {}
    for _, owner in BINDING_OWNERS:
        for b in owner.BINDINGS:
            for key in b.key.split(","):
                out[(b.id, key.strip())] = b.action
    return out


class Terminal:
    """The app in a pty: ``write`` bytes, wait for trace records and store rows."""

    def __init__(self, tmp: Path, *, cols: int = 100, rows: int = 30, args=()) -> None:
        self.tmp = tmp
        self.trace_path = tmp / "trace.jsonl"
        self.db = tmp / "data" / "conversations.sqlite"
        self.output = bytearray()
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = dict(os.environ, TERM="xterm-256color", PYTHONPATH=os.pathsep.join(sys.path))
        env.pop("TEXTUAL", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "fake_app.py"),
                "--data-dir",
                str(tmp / "data"),
                "--cache-dir",
                str(tmp / "kv"),
                "--trace",
                str(self.trace_path),
                *args,
            ],
            cwd=ROOT,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
        )
        os.close(slave)
        self.master = master
        self.seen = 0  # trace records consumed by wait_action
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.wait_for(lambda r: r.get("ready"), "the app to start")

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.output.extend(data)
            del self.output[:-200_000]

    def trace(self) -> list[dict]:
        try:
            lines = self.trace_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def wait_for(self, predicate, what: str, timeout: float = TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            records = self.trace()
            for i in range(self.seen, len(records)):
                if predicate(records[i]):
                    self.seen = i + 1
                    return records[i]
            if self.proc.poll() is not None:
                tail = bytes(self.output[-3000:]).decode(errors="replace")
                raise AssertionError(f"the app exited while waiting for {what}:\n{tail}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; trace: {records[-8:]}")
            time.sleep(0.02)

    def write(self, data: bytes) -> None:
        os.write(self.master, data)

    def press(self, key: str, action: str, *, ok: bool = True) -> dict:
        """Type ``key`` as bytes and wait until the app ran ``action`` (``ok``: it ran,
        False: it was offered but not available)."""
        self.write(key_bytes(key))
        record = self.wait_for(lambda r: r.get("action") == action, f"{key} -> {action}")
        assert record["ok"] is ok, (key, record)
        return record

    def rows(self, sql: str, args=()) -> list[tuple]:
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True) as conn:
            return conn.execute(sql, args).fetchall()

    def until(self, predicate, what: str, timeout: float = TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.02)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.write(b"\x11")  # ctrl+q
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        os.close(self.master)


class TmuxTerminal(Terminal):
    """The app in a tmux pane: bytes go in with ``send-keys -H``, ``screen()`` reads the
    pane. One tmux server per terminal (its socket in ``tmp``), killed by :meth:`close`.

    ``COLUMNS``/``LINES`` are set for the app: started from pytest, the pane's app
    otherwise read a 4-column-wide input from ``shutil.get_terminal_size()`` and
    Textual's TextArea crashed wrapping its placeholder at width 0."""

    def __init__(self, tmp: Path, *, cols: int = 100, rows: int = 30, args=()) -> None:
        self.tmp = tmp
        self.trace_path = tmp / "trace.jsonl"
        self.db = tmp / "data" / "conversations.sqlite"
        self.output = bytearray()
        self.seen = 0
        self.socket = str(tmp / "tmux.sock")
        command = [
            sys.executable,
            str(HERE / "fake_app.py"),
            "--data-dir",
            str(tmp / "data"),
            "--cache-dir",
            str(tmp / "kv"),
            "--trace",
            str(self.trace_path),
            *args,
        ]
        env = (
            "-e",
            f"PYTHONPATH={os.pathsep.join(sys.path)}",
            "-e",
            "TERM=xterm-256color",
            "-e",
            f"COLUMNS={cols}",
            "-e",
            f"LINES={rows}",
        )
        shell = " ".join(shlex.quote(c) for c in command)
        self._tmux("-f", "/dev/null", "new-session", "-d", "-x", str(cols), "-y", str(rows),
                   *env, "-c", str(ROOT), shell, ";", "set-option", "remain-on-exit", "on")  # fmt: skip
        self.proc = _Pane(self)
        try:
            self.wait_for(lambda r: r.get("ready"), "the app to start")
        except BaseException:
            self.close()
            raise

    def _tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-S", self.socket, *args], check=True, capture_output=True, text=True
        ).stdout

    def write(self, data: bytes) -> None:
        self._tmux("send-keys", "-t", "0", "-H", *(f"{b:02x}" for b in data))

    def screen(self) -> str:
        """The pane's text now, one line per row."""
        return self._tmux("capture-pane", "-p", "-t", "0")

    @property
    def output(self) -> bytes:  # what wait_for shows when the app exits
        return self._tmux("capture-pane", "-p", "-t", "0", "-S", "-").encode()

    @output.setter
    def output(self, _value) -> None:
        pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self.write(b"\x11")  # ctrl+q
            self.until(lambda: self.proc.poll() is not None, "the app to quit", 5)
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True)


class _Pane:
    """``poll()`` as on a ``Popen``: None while the pane's command runs."""

    def __init__(self, term: TmuxTerminal) -> None:
        self.term = term

    def poll(self) -> int | None:
        dead = self.term._tmux("list-panes", "-t", "0", "-F", "#{pane_dead}").strip()
        return None if dead == "0" else 0


@pytest.fixture
def terminal(tmp_path):
    term = Terminal(
        tmp_path, args=("--reasoning", "Weighing the question.", "--token-delay", "0.03")
    )
    yield term
    term.close()


def user_messages(term: Terminal) -> list[str]:
    return [r[0] for r in term.rows("SELECT content FROM nodes WHERE role='user' ORDER BY id")]


def replies(term: Terminal) -> int:
    return term.rows("SELECT count(*) FROM nodes WHERE role='assistant'")[0][0]


def conversations(term: Terminal) -> int:
    return term.rows("SELECT count(*) FROM conversations")[0][0]


def test_text_and_enter_in_one_write_sends(tmp_path):
    term = Terminal(tmp_path)
    try:
        term.write(b"hello there\r")  # one read on the app's side, as tmux delivers it
        term.wait_for(lambda r: r.get("action") == "send", "send")
        term.until(lambda: replies(term) == 1, "the reply")
        assert user_messages(term) == ["hello there"]
    finally:
        term.close()


def test_every_binding_in_the_help_is_typed(terminal):
    term = terminal
    bindings = help_bindings()
    typed: set[tuple[str, str]] = set()

    def press(binding_id: str, key: str, *, ok: bool = True) -> dict:
        record = term.press(key, bindings[(binding_id, key)], ok=ok)
        typed.add((binding_id, key))
        return record

    def generating(start) -> None:
        """Run ``start()`` and wait for one more reply, stored and shown."""
        before = replies(term)
        start()
        term.until(lambda: replies(term) > before, "a reply")
        term.wait_for(lambda r: r.get("streaming") is False, "the reply to finish")

    def send(text: bytes) -> None:
        term.write(text + b"\r")
        term.wait_for(lambda r: r.get("action") == "send", "send")

    # -- the input: send, newline (two keys), text + Enter in one write
    generating(lambda: send(b"first question"))
    typed.add(("send", "enter"))

    def multiline() -> None:
        term.write(b"a")
        press("newline", "ctrl+j")
        term.write(b"b")
        press("newline", "shift+enter")
        term.write(b"c")
        press("newline", "alt+enter")
        send(b"d")

    generating(multiline)
    assert user_messages(term)[-1] == "a\nb\nc\nd"

    # -- screen keys from the input
    generating(lambda: press("regenerate", "ctrl+r"))
    press("swipe_prev", "alt+left")
    press("swipe_next", "alt+right")
    term.write(b"stop me too\r")
    term.wait_for(lambda r: r.get("streaming") is True, "streaming")
    press("interrupt", "ctrl+c")  # stops the reply; the app stays (the next steps run)
    term.wait_for(lambda r: r.get("streaming") is False, "the stop")
    term.write(b"stop me please\r")
    term.wait_for(lambda r: r.get("streaming") is True, "streaming")
    press("stop", "escape")
    term.wait_for(lambda r: r.get("streaming") is False, "the stop")

    # -- the message cursor
    press("to_messages", "escape")  # not streaming: Esc moves onto the messages
    press("msg_up", "up")
    press("msg_up", "k")
    press("msg_down", "down")
    press("msg_down", "j")
    press("msg_first", "home")
    press("msg_last", "end")
    press("toggle_reasoning", "t")  # the fake replies think first
    press("copy", "c")
    press("msg_done", "escape")
    press("select_prev", "alt+up")
    press("msg_done", "enter")
    press("select_next", "alt+down")
    press("msg_done", "i")

    # a reply with siblings: r makes one, then ←/→ and h/l move between them
    generating(lambda: send(b"again"))
    press("select_prev", "alt+up")
    generating(lambda: press("msg_regenerate", "r"))
    press("select_prev", "alt+up")
    press("msg_prev_branch", "left")
    press("msg_next_branch", "right")
    press("msg_prev_branch", "h")
    press("msg_next_branch", "l")

    # edit the first user message: a new branch; then back to the original with ←
    press("msg_first", "home")

    def edit() -> None:
        press("edit", "e")
        term.wait_for(lambda r: r.get("screen") == "EditMessageScreen" and "focus" in r, "edit")
        term.write(b" (edited)")  # the cursor starts at the end
        press("edit_save", "ctrl+s")

    generating(edit)
    assert "first question (edited)" in user_messages(term)
    press("select_prev", "alt+up")
    press("msg_first", "home")
    press("msg_prev_branch", "left")  # the user message shows ◀ 2/2 ▶ now
    root = term.rows("SELECT n.content FROM conversations c JOIN nodes n ON n.id = c.selected_root")
    assert root == [("first question",)]

    # fork at that user message, then generate there
    press("fork", "f")
    term.until(lambda: conversations(term) == 2, "the fork")
    generating(lambda: press("regenerate", "ctrl+r"))  # the fork ends in a user message
    press("select_prev", "alt+up")
    press("edit", "e")
    press("edit_cancel", "escape")

    # -- modals from the input
    press("rename_conversation", "ctrl+t")
    press("prompt_cancel", "escape")
    press("conversation_settings", "f9")
    press("settings_cancel", "escape")
    press("conversation_settings", "f9")
    press("settings_save", "ctrl+s")
    press("pick_model", "f4")
    press("picker_cancel", "escape")
    press("help", "f1")
    press("help_close", "escape")
    press("help", "f1")
    press("help_close", "q")
    press("help", "f1")
    press("help_close", "f1")
    term.write(b"\x10")  # ctrl+p: the palette (Textual's binding, listed in the help)
    term.wait_for(lambda r: r.get("action") == "command_palette", "the palette")
    term.write(b"\x1b")
    term.wait_for(lambda r: r.get("screen") == "ChatScreen", "the palette to close", 5)

    # -- layout
    press("toggle_panels", "f2")
    press("toggle_panels", "f2")
    press("toggle_conversations", "f3")
    press("toggle_conversations", "f3")  # shown again, with the focus
    press("delete_conversation", "delete")
    press("confirm_no", "n")
    assert conversations(term) == 2

    # -- cache clears confirm first
    press("clear_hot", "f5")
    press("confirm_no", "escape")
    press("clear_ssd", "f6")
    press("confirm_yes", "y")
    press("clear_tails", "f7")
    press("confirm_yes", "y")
    press("clear_all", "f8")
    press("confirm_yes", "y")
    status_path = term.tmp / "kv" / STATUS_FILE

    def cleared():
        status = json.loads(status_path.read_text())
        return status if status["stats"]["hot"]["entries"] == 0 else None

    status = term.until(cleared, "the clears to show in the status file")
    assert status["pid"] == term.proc.pid and status["model"] == "demo"

    press("new_conversation", "ctrl+n")
    press("quit", "ctrl+q")
    term.proc.wait(10)

    from test_console_keys import CONSOLE_BINDINGS  # typed there
    from test_terminal_keys_tools import TOOL_BINDINGS  # typed there
    from test_tool_round_keys import APPROVAL_BINDINGS  # typed there

    typed_elsewhere = TOOL_BINDINGS | CONSOLE_BINDINGS | APPROVAL_BINDINGS
    missing = sorted(set(bindings) - typed - typed_elsewhere)
    assert not missing, f"bindings the help lists but this test never typed: {missing}"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_daily_keys_and_literal_text_in_tmux(tmp_path):
    """Issue 21 in tmux with real bytes: the user's text shows as typed; Ctrl+C stops a
    reply and the app stays; Alt+arrows swipe as ``ESC [1;3D`` and as ``ESC ESC [D``;
    Alt+Enter is a newline; the edit dialog's cursor starts at the end."""
    term = TmuxTerminal(tmp_path, args=("--token-delay", "0.03"))
    try:
        # -- literal text, with a line break by Alt+Enter (ESC CR)
        term.write(b"In HTML, what does <br> do? compute 2*3*4\x1b\rroses are _red_\r")
        term.wait_for(lambda r: r.get("streaming") is False, "the reply")
        assert user_messages(term) == ["In HTML, what does <br> do? compute 2*3*4\nroses are _red_"]
        screen = term.until(
            lambda: "compute 2*3*4" in term.screen() and term.screen(),
            "the text shown",
        )
        assert "In HTML, what does <br> do? compute 2*3*4" in screen
        assert "roses are _red_" in screen.split("compute 2*3*4", 1)[1].splitlines()[1]

        # -- Ctrl+C during a reply stops it; the app stays
        term.write(b"tell me a long story\r")
        term.wait_for(lambda r: r.get("streaming") is True, "streaming")
        term.press("ctrl+c", "stop")
        term.wait_for(lambda r: r.get("streaming") is False, "the stop")
        assert term.proc.poll() is None
        assert "Do you want to quit" not in term.screen()
        stopped = term.rows(
            "SELECT json_extract(meta, '$.finish_reason') FROM nodes WHERE role='assistant' "
            "ORDER BY id DESC LIMIT 1"
        )
        assert stopped == [("cancelled",)]

        # -- Alt+arrows in both encodings swipe between two replies
        term.write(b"\x12")  # ctrl+r: a second reply
        term.wait_for(lambda r: r.get("streaming") is False, "the second reply")
        for encoded in (b"\x1b[1;3D", b"\x1b\x1b[C", b"\x1b\x1b[D", b"\x1b[1;3C"):
            term.write(encoded)
            record = term.wait_for(lambda r: "action" in r, f"the action of {encoded!r}")
            assert record["action"].startswith("swipe(") and record["ok"], (encoded, record)
        term.until(lambda: "2/2 " in term.screen(), "the last reply shown, 2/2")

        # -- the edit dialog: type at once, the text goes after the message
        term.write(b"\x1b")  # onto the messages
        term.wait_for(lambda r: r.get("action") == "to_messages", "the message cursor")
        term.press("home", "select_edge(0)")
        term.press("e", "edit")
        term.wait_for(lambda r: r.get("screen") == "EditMessageScreen" and "focus" in r, "edit")
        term.write(b" (edited)")
        term.until(lambda: "(edited)" in term.screen(), "the typed text")
        term.write(b"\x13")  # ctrl+s
        term.until(lambda: any(m.endswith("_red_ (edited)") for m in user_messages(term)), "edit")
    finally:
        term.close()
