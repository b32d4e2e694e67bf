"""One clear report for every process (docs/DESIGN.md §10): a clear asked of a running
``serve``/``chat``/``replay`` (the status service), of a running TUI (its clear requests),
and ``tierchat cache clear`` in its own process answer in the same words, built by
``core.live_status.clear_tier`` alone. Fake engines, no model, no Textual app."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from fakes import FakeEngine
from tierchat.cli import cache_cmd
from tierchat.core.api import Finished, GenerateRequest
from tierchat.core.live_status import (
    StatusService,
    StatusWriter,
    clear_tier,
    request_clear,
    wait_cleared,
)
from tierchat.tui.services.clear_requests import ClearRequests

TEXT = "a prompt long enough to fill two blocks of sixteen tokens and a tail"


def filled() -> FakeEngine:
    """A fake engine whose tiers hold one reply's blocks and tail (the same in each)."""
    engine = FakeEngine("fake")
    prompt = tuple(engine.tokenizer.encode(TEXT))
    assert isinstance(engine.submit(GenerateRequest(prompt_ids=prompt)).wait(10), Finished)
    return engine


def through_the_status_service(tmp_path, tier: str) -> str:
    engine = filled()
    service = StatusService(engine, tmp_path / "serve", "serve")
    rid = request_clear(tmp_path / "serve", tier)
    service.poll()  # one poll serves the request (no thread started)
    answer = wait_cleared(tmp_path / "serve", rid, timeout_s=0)
    engine.close()
    return answer["report"]


class Node:
    """What ``ClearRequests`` asks of a widget: a worker (run here, at once) and its app's
    ``call_from_thread`` (likewise)."""

    def __init__(self) -> None:
        self.app = SimpleNamespace(call_from_thread=lambda fn, *a: fn(*a))

    def run_worker(self, work, **_kw) -> None:
        work()


def through_the_tui(tmp_path, tier: str) -> tuple[str, str]:
    """The TUI's answer to a request from the command line, and the note it shows."""
    engine, notes = filled(), []
    status = StatusWriter(tmp_path / "tui", pid=None)
    clears = ClearRequests(
        Node(), lambda: engine, lambda text, **kw: notes.append(text), lambda: None, status
    )
    request_clear(tmp_path / "tui", tier)
    clears.serve()
    engine.close()
    (served,) = status.clears
    return served["report"], notes[-1]


def in_its_own_process(tmp_path, tier: str, capsys, monkeypatch) -> str:
    engine = filled()
    monkeypatch.setattr(cache_cmd, "start_engine", lambda settings, model: engine)
    settings = SimpleNamespace(cache_dir=tmp_path / "own", sources={"model": "flag"}, model="m")
    assert cache_cmd.run_cache(settings, "clear", SimpleNamespace(tier=tier)) == 0
    report, by = capsys.readouterr().out.splitlines()
    assert by == "  by this process (model m)"
    return report


@pytest.mark.parametrize("tier", ["hot", "tails", "all"])
def test_every_path_answers_a_clear_in_the_same_words(tmp_path, tier, capsys, monkeypatch):
    served = through_the_status_service(tmp_path, tier)
    tui, note = through_the_tui(tmp_path, tier)
    own = in_its_own_process(tmp_path, tier, capsys, monkeypatch)
    assert served == tui == note == own
    assert re.match(rf"Cleared {tier}: .*−\d", served), served  # something went, in figures
    assert "already empty" not in served


def test_an_unknown_tier_is_refused_in_the_same_words(tmp_path):
    engine = FakeEngine("fake")
    with pytest.raises(ValueError) as refused:
        clear_tier(engine, "l2")
    served = through_the_status_service(tmp_path, "l2")
    tui = StatusWriter(tmp_path / "tui")
    clears = ClearRequests(Node(), lambda: engine, lambda *a, **k: None, lambda: None, tui)
    request_clear(tmp_path / "tui", "l2")
    clears.serve()
    engine.close()
    assert served == tui.clears[0]["report"] == f"failed: {refused.value}"
    assert "unknown tier 'l2': expected one of hot, ssd, tails, all" in served


def test_a_second_clear_finds_it_already_empty(tmp_path):
    engine = filled()
    clear_tier(engine, "all")
    assert clear_tier(engine, "all") == "Cleared all: it was already empty."
    engine.close()
