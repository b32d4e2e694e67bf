"""``tierchat verify``: would these replies have been the same without the cache?

    tierchat verify SCRIPT.jsonl          replay the script (as ``tierchat replay``) and
                                          verify each reply right after it is made
    tierchat verify --conversation ID     every reply on a stored conversation's active path
    tierchat verify --node ID             one stored reply

Each reply's prompt is run teacher-forced on the reply, through the cache and twice cold
(:mod:`tierchat.core.chat.verify`, docs/DESIGN.md §18). Output: JSON lines. For a script, the
replay's own lines and, after each generating op, ``{"op_index", "op", "node_id",
"verify", "line"}``; for stored replies ``{"node_id", "verify", "line"}``. ``verify`` holds
``cached`` (cached vs cold) and ``floor`` (cold vs cold), each ``positions``,
``top1_agree``, ``first_diff`` (null: bit for bit) and ``max_dlogprob``, with
``prompt_tokens`` and ``cached_tokens``. Reports are stored with the replies (the store of
``--data-dir``; a script's store is thrown away unless ``--data-dir`` is given). Exit 1
when a reply could not be verified.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tierchat.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CLIError,
    check_cache_owner,
    new_session,
    open_store,
    start_engine,
)
from tierchat.cli.replay import Op, Replay, run_script


def _line(report: Any, **head: Any) -> dict[str, Any]:
    return {**head, "verify": report.to_dict(), "line": report.describe()}


class VerifyReplay(Replay):
    """A replay that verifies each reply right after it is made (same engine, same cache
    state as the turn left it)."""

    def generate(self, op: Op) -> None:
        from tierchat.core.chat.verify import VerifyError, verify_reply

        before = len(self.results)
        super().generate(op)
        turn = self.session.current
        node = getattr(turn, "reply_node", None)
        if len(self.results) == before or node is None:
            return
        try:
            report = verify_reply(self.session, node.id)
        except VerifyError as e:
            self._fail(op, f"verify: {e}")
            return
        self._emit(_line(report, op_index=op.index, op=op.op, node_id=node.id))


def run_verify(settings: Any, args: Any) -> int:
    """``tierchat verify``; returns the exit code."""
    script, cid, nid = args.script, args.conversation, args.node
    if (script is None) == (cid is None and nid is None) or (cid is not None and nid is not None):
        raise CLIError("verify: give a SCRIPT, or --conversation ID, or --node ID", EXIT_USAGE)
    if script is not None:
        return run_script(VerifyReplay, settings, script, data_dir_given="data_dir" in args)
    return _verify_stored(settings, cid, nid)


def _verify_stored(settings: Any, cid: int | None, nid: int | None) -> int:
    from tierchat.core.chat.store import ConversationError
    from tierchat.core.chat.verify import VerifyError, verify_reply

    store = open_store(settings.db_path)
    try:
        try:
            if nid is not None:
                nodes = [store.get_node(nid)]
            else:
                nodes = [n for n in store.active_path(cid) if n.role == "assistant"]
        except ConversationError as e:
            raise CLIError(str(e), EXIT_USAGE) from None
        if not nodes:
            raise CLIError(f"conversation {cid} has no reply to verify", EXIT_USAGE)
        check_cache_owner(settings)
        engine = start_engine(settings)
        failed = 0
        try:
            session = new_session(engine, store, settings)
            session.open(nodes[0].conversation_id)
            for node in nodes:
                try:
                    report = verify_reply(session, node.id)
                except VerifyError as e:
                    failed += 1
                    print(json.dumps({"node_id": node.id, "error": str(e)}), flush=True)
                    print(f"error: reply {node.id}: {e}", file=sys.stderr, flush=True)
                    continue
                print(json.dumps(_line(report, node_id=node.id)), flush=True)
        finally:
            engine.close()
        return EXIT_FAILED if failed else EXIT_OK
    finally:
        store.close()
