"""Processes opening a fresh data dir at once all get a working store
(a busy timeout, and one migration under ``BEGIN IMMEDIATE``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from tierchat.core.chat.sqlite import SCHEMA_VERSION
from tierchat.core.chat.store import ConversationStore

OPENER = textwrap.dedent(
    """
    import sys, time
    from tierchat.core.chat.store import ConversationStore
    start = float(sys.argv[2])
    while time.time() < start:
        time.sleep(0.001)
    store = ConversationStore(sys.argv[1])
    store.create_conversation(title="from " + sys.argv[3])
    store.close()
    print("ok")
    """
)


def test_twenty_processes_open_one_fresh_store_at_once(tmp_path):
    path = tmp_path / "data" / "store.db"
    start = time.time() + 3.0  # every process imported and waiting by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, str(path), str(start), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ,
        )
        for i in range(20)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    failures = [err.strip().splitlines()[-1:] for out, err in results if out.strip() != "ok"]
    assert failures == []
    with ConversationStore(path) as store:
        assert store.schema_version == SCHEMA_VERSION
        assert len(store.list_conversations()) == 20
    assert (path.stat().st_mode & 0o777) == 0o600
    assert (path.parent.stat().st_mode & 0o777) == 0o700
