"""How long the TUI takes to rebuild a conversation's transcript, by length (issue 13 #11).

    python scripts/transcript_bench.py                 # 20, 50, 100, 200 turns
    python scripts/transcript_bench.py --turns 200 --repeat 20

For each length a store is filled with that many user/assistant turns (every reply with
metrics in its meta, every third user message with an edited sibling and every reply
with a regenerated sibling, so the sibling counts are not trivial). It then times, side by
side in one run:

- ``old``: the pre-fix walk, ``user_turns`` -> ``replies`` -> ``active_path`` per reply
  (what ``path_infos`` did): O(n^2) queries;
- ``path``: the fix, ``ChatSession.path_entries`` (one recursive SQL query) +
  ``message_infos`` -- what the screen runs after every finished reply;
- ``sync``: ``path`` + ``Transcript.sync`` of a mounted transcript to a path that gained
  one reply (headless Textual app): the whole per-reply refresh on the UI thread. The
  transcript mounts the newest ``Transcript.WINDOW`` messages (older ones on demand),
  because Textual lays out every mounted widget of a scroll view on each refresh;
- ``mount``: the first mount of a conversation (the window), once per open.

Prints one line per length with milliseconds (median of ``--repeat`` runs).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def fill(store, turns: int) -> int:
    from tierchat.core.api import TurnMetrics

    metrics = {"prompt_tokens": 800, "cached_tokens": 768, "prefill_tokens": 32, "model": "demo"}
    metrics.update({"cached_by": {"hot": 768, "ssd": 0}, "finish_reason": "stop"})
    assert set(metrics) - {"model"} <= set(TurnMetrics.__dataclass_fields__)
    cid = store.create_conversation("bench", system="You are terse.")
    parent = store.active_path(cid)[-1].id
    for i in range(turns):
        if i % 3 == 0:
            store.add_node(cid, parent, "user", f"draft {i}", select=False)
        user = store.add_node(cid, parent, "user", f"Question {i}: " + "words " * 20)
        store.add_node(cid, user.id, "assistant", "older reply", meta=metrics, select=False)
        reply = store.add_node(
            cid, user.id, "assistant", f"Answer {i}. " + "text " * 60, meta=metrics
        )
        parent = reply.id
    return cid


def old_infos(session) -> list:
    """The walk ``ChatScreen.path_infos`` did before the fix (one query per call)."""
    from tierchat.tui.format import metrics_from_meta
    from tierchat.tui.widgets.transcript import MessageInfo

    infos, turn = [], -1
    for node in session.active_path():
        if node.role == "user":
            turn += 1
            infos.append(MessageInfo(node.id, "user", node.content, turn))
        elif node.role == "assistant":
            replies = [r.id for r in session.replies(turn)]
            infos.append(
                MessageInfo(
                    node.id,
                    "assistant",
                    node.content,
                    turn,
                    replies.index(node.id),
                    len(replies),
                    metrics_from_meta(node.meta),
                )
            )
        else:
            infos.append(MessageInfo(node.id, "system", node.content, -1))
    return infos


def new_infos(session) -> list:
    from tierchat.tui.widgets.transcript import message_infos

    return message_infos(session.path_entries(), session.settings().system)


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


async def sync_ms(session, repeat: int) -> tuple[float, float]:
    """(first mount of the whole transcript, per-reply refresh) in ms, headless."""
    from textual.app import App
    from tierchat.tui.widgets.transcript import MessageInfo, Transcript

    class Bench(App):
        def compose(self):
            yield Transcript(id="t")

    app = Bench()
    async with app.run_test(size=(140, 44)) as pilot:
        transcript = app.query_one(Transcript)
        infos = new_infos(session)
        t0 = time.perf_counter()
        await transcript.sync(infos[:-1])
        await pilot.pause()
        mount_ms = (time.perf_counter() - t0) * 1000
        times = []
        for i in range(repeat):
            t0 = time.perf_counter()
            infos = new_infos(session)
            if i % 2:  # alternate: one reply gained, one reply swapped for a sibling
                infos[-1] = MessageInfo(-1, "assistant", f"streamed {i}", infos[-1].turn)
            await transcript.sync(infos)
            times.append((time.perf_counter() - t0) * 1000)
        return mount_ms, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", default="20,50,100,200")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()

    from fakes import FakeEngine
    from tierchat.core.chat.session import ChatSession
    from tierchat.core.chat.store import ConversationStore

    print(
        f"{'turns':>5} {'messages':>8} {'old ms':>8} {'path ms':>8} {'speedup':>8} "
        f"{'sync ms':>8} {'mount ms':>9}"
    )
    engine = FakeEngine("demo")
    try:
        for turns in (int(t) for t in args.turns.split(",")):
            store = ConversationStore(":memory:")
            session = ChatSession(engine, store)
            session.open(fill(store, turns))

            def replies(infos):  # the old walk knew no user-message siblings
                return [(i.node_id, i.index, i.count) for i in infos if i.role == "assistant"]

            assert replies(old_infos(session)) == replies(new_infos(session))
            old = median_ms(lambda s=session: old_infos(s), max(1, args.repeat // 3))
            new = median_ms(lambda s=session: new_infos(s), args.repeat)
            mount, sync = asyncio.run(sync_ms(session, args.repeat))
            n = len(new_infos(session))
            print(
                f"{turns:>5} {n:>8} {old:>8.1f} {new:>8.1f} {old / new:>7.0f}x "
                f"{sync:>8.1f} {mount:>9.0f}"
            )
            store.close()
    finally:
        engine.close()


if __name__ == "__main__":
    main()
