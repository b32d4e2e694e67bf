"""The shipped agent-CLI sessions (cli/workloads/agent-*.jsonl) load, and each is one
growing conversation: every main request's conversation extends the previous one's."""

from __future__ import annotations

import gzip
import json

import pytest
from tierchat.cli.bench.agent_sessions import SESSION_NAMES, load_session

EXPECTED_API = {"claude-code": "messages", "codex": "responses", "opencode": "chat"}


def plain(value):
    """As a chat template sees it: no cache_control marks, text blocks as one string."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        if value and all(isinstance(v, dict) and v.get("type") == "text" for v in value):
            return "".join(v["text"] for v in value)
        return [plain(v) for v in value]
    return value


def conversation(r) -> list:
    return r.body["input"] if r.api == "responses" else r.body["messages"]


@pytest.mark.parametrize("name", SESSION_NAMES)
def test_a_shipped_session_is_one_growing_conversation(name):
    requests = load_session(name)
    assert {r.api for r in requests} == {EXPECTED_API[name]}
    main = [r for r in requests if r.has_tools]
    assert len(main) >= 6
    for before, after in zip(main, main[1:], strict=False):
        old, new = conversation(before), conversation(after)
        assert len(new) > len(old)
        # earlier turns come back as sent, but for what a client re-renders (Claude Code's
        # first system message: blocks, then a string; moved cache_control marks)
        assert plain(new[: len(old)]) == plain(old)
    assert all("agent-rec-" not in json.dumps(r.body) for r in requests)  # scratch paths


def test_load_session_reads_gzip_and_names_a_bad_line(tmp_path):
    line = {"api": "chat", "path": "/v1/chat/completions", "body": {"messages": []}}
    path = tmp_path / "s.jsonl.gz"
    path.write_bytes(gzip.compress((json.dumps(line) + "\n").encode()))
    (r,) = load_session(path)
    assert (r.api, r.path, r.body, r.has_tools) == ("chat", line["path"], line["body"], False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(line) + "\n" + json.dumps({**line, "api": "grpc"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_session(bad)
    with pytest.raises(FileNotFoundError):
        load_session(tmp_path / "missing.jsonl")
