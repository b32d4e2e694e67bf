"""``tierchat chat`` (cli/chat.py): the line-mode loop over a real ``ChatSession`` on the
fake engine and an in-memory store: what ``/set`` takes and echoes."""

from __future__ import annotations

import io

import pytest
from fakes import FakeEngine
from tierchat.cli.chat import LineChat
from tierchat.core.chat.conversation_settings import ConversationSettings
from tierchat.core.chat.session import ChatSession
from tierchat.core.chat.store import ConversationStore
from tierchat.core.sampling_params import SamplingParams


@pytest.fixture
def engine():
    engine = FakeEngine("demo")
    yield engine
    engine.close()


@pytest.fixture
def session(engine):
    store = ConversationStore(":memory:")
    session = ChatSession(
        engine, store, ConversationSettings(sampling=SamplingParams(max_tokens=16))
    )
    session.new_conversation()
    yield session
    store.close()


def chat(session, lines: str) -> tuple[str, str]:
    """Run the loop over ``lines`` (end of input ends it); returns (stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    LineChat(session, io.StringIO(lines), out, err).loop()
    return out.getvalue(), err.getvalue()


def test_set_takes_presence_and_frequency_penalties(session, engine):
    out, err = chat(session, "/set presence_penalty 0.5\n/set frequency_penalty -0.25\nhello\n")
    assert err == ""
    request = engine.requests[-1]
    assert (request.sampling.presence_penalty, request.sampling.frequency_penalty) == (0.5, -0.25)
    saved = session.store.conversation_settings(session.conversation_id)
    assert (saved["presence_penalty"], saved["frequency_penalty"]) == (0.5, -0.25)
    out, err = chat(session, "/set presence_penalty 3\n")
    assert "presence_penalty must be in -2..2" in err
    assert session.settings().sampling.presence_penalty == 0.5  # the bad value was not saved


class InterruptingOut(io.StringIO):
    """The chat's output: Ctrl+C (KeyboardInterrupt) arrives while the reply's first
    text is printed, as a terminal's SIGINT would during a stream."""

    interrupted = False

    def write(self, text: str) -> int:
        n = super().write(text)
        if text.strip() and "assistant>" not in text and not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return n


def test_ctrl_c_during_a_reply_says_stopping_once(session, engine):
    engine.gate.clear()  # decode holds after the first batch until the cancel
    out, err = InterruptingOut(), io.StringIO()
    LineChat(session, io.StringIO("tell me a story\n"), out, err).loop()
    text = out.getvalue()
    assert out.interrupted
    assert text.count("[stopping…]") == 1, text
    assert "cancelled" in text  # the metrics line of the stopped reply follows
    assert engine.stats().last_turn.finish_reason == "cancelled"


def test_set_echoes_plain_values(session):
    lines = (
        "/set temperature 0.8\n/set top_k 40\n/set seed\n/set seed 7\n"
        "/set stop END|\\n\\n\n/set system Be brief.\n/set swipe_temperature 1\n/set\n"
    )
    out, err = chat(session, lines)
    assert err == ""
    echoed = out.splitlines()
    assert echoed[:7] == [
        "[temperature = 0.8]",
        "[top_k = 40]",
        "[seed = none]",
        "[seed = 7]",
        "[stop = END|\\n\\n]",  # as typed: \n for a line break
        "[system = Be brief.]",
        "[swipe_temperature = 1]",
    ]
    assert session.settings().sampling.stop == ("END", "\n\n")
    listing = echoed[7:]
    assert "[max_tokens = 16]" in listing and "[seed = 7]" in listing
    assert "[presence_penalty = 0]" in listing and "[stop = END|\\n\\n]" in listing
    assert not any("'" in line or "None" in line or "(" in line for line in listing), listing


def test_set_says_what_a_bad_value_should_be(session):
    lines = (
        "/set temperature warm\n/set top_k 2.5\n/set seed x\n/set max_tokens\n"
        "/set temperature 9\n/set colour blue\n"
    )
    out, err = chat(session, lines)
    assert err.splitlines() == [
        'error: temperature takes a number (not "warm")',
        'error: top_k takes an integer (not "2.5")',
        'error: seed takes an integer, or none (not "x")',
        "error: max_tokens takes an integer (none given)",
        "error: temperature must be in 0..5, not 9.0",
        "error: unknown setting colour; /set lists them",
    ]
    assert out == ""
    assert session.settings().sampling.temperature == 0.0  # nothing bad was saved
