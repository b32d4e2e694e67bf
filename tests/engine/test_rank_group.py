"""The engine's peers (docs/DESIGN.md §19) without subprocesses.

- The start agreement of :class:`RankGroup` (one exchange: chunk, request, restore
  position), run by simulated ranks on threads whose collectives meet at a barrier, over
  request objects that plan and restore from a table: every rank lands on one position,
  the highest all of them can reach.
- The real engine with a :class:`RankGroup` over a one-rank transport: requests take the
  ranks' path (each scheduler action sent before it runs, the restore agreed through the
  request object, tokens through the shared sampler) and still equal a cold run.
"""

from __future__ import annotations

import contextlib
import json
import threading

import pytest
from engine_kit import assert_same, generate, make_engine, random_prompt
from tierchat.config.settings import Settings
from tierchat.core.cache.plans import Restored
from tierchat.core.engine import actions
from tierchat.core.engine.distributed import RankError
from tierchat.core.engine.engine import Engine
from tierchat.core.engine.ranks import OneProcess, RankGroup
from tierchat.core.memory.prefill import PrefillRefused

# ------------------------------------------------------------------ simulated ranks


class Collective:
    """Element-wise min/max over ``size`` threads: each call waits for every rank's."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.rows: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def reduce(self, rank: int, values, op) -> list[int]:
        rows = self.rows_of(rank, values)
        return [op(col) for col in zip(*rows, strict=True)]

    def rows_of(self, rank: int, values) -> list[list[int]]:
        self.rows[rank] = [values] if isinstance(values, int) else list(values)
        self.barrier.wait()
        out = [list(r) for r in self.rows]
        self.barrier.wait()  # every rank read the rows before the next call writes them
        self.calls = getattr(self, "calls", 0) + (rank == 0)
        return out


class ThreadRank:
    """One simulated rank of a :class:`Collective` (the part of ``dist.Ranks`` that
    :meth:`RankGroup.start` uses)."""

    def __init__(self, collective: Collective, rank: int) -> None:
        self.collective, self.rank, self.size = collective, rank, collective.size
        self.is_main, self.failed, self.on_timeout = rank == 0, "", None

    def all_min(self, values) -> list[int]:
        return self.collective.reduce(self.rank, values, min)

    def all_max(self, values) -> list[int]:
        return self.collective.reduce(self.rank, values, max)

    def gather(self, row) -> list[list[int]]:
        return self.collective.rows_of(self.rank, row)


class TableTurn:
    """A request object that can restore the positions in ``reachable`` (a plan takes the
    highest at most the limit); a restore lands ``short`` lower where given (a file lost
    since the plan). Records every call."""

    def __init__(self, n: int, reachable, short=None, repeat: bool = False) -> None:
        self.prompt = list(range(n))
        self.reachable = sorted(set(reachable) | {0})
        self.short = dict(short or {})
        self.repeat = repeat
        self.calls: list = []

    def offer_repeat(self) -> bool:
        self.calls.append("offer")
        return self.repeat

    def decline_repeat(self) -> None:
        self.calls.append("decline")

    def plan_position(self, limit: int) -> int:
        return max(p for p in self.reachable if p <= max(limit, 0))

    def restore(self, max_position=None) -> Restored:
        self.calls.append(("restore", max_position))
        if max_position is None:
            return Restored(len(self.prompt))  # the repeat it offered
        p = self.plan_position(max_position)
        return Restored(self.short.get(p, p))

    def restore_cold(self) -> Restored:
        self.calls.append("cold")
        return Restored(0)

    def log(self, text: str) -> None:
        self.calls.append(text)

    def close(self) -> None:
        self.calls.append("close")


def agree(*turns: TableTurn, chunks=None, digests=None) -> list:
    """Run :meth:`RankGroup.start` on one thread per turn, as that many ranks; each
    rank's :class:`~tierchat.core.engine.ranks.Agreed` (``calls``: the exchanges)."""
    collective = Collective(len(turns))
    out: list = [None] * len(turns)
    errors: list = []
    chunks = chunks or [64] * len(turns)
    digests = digests or [7] * len(turns)

    def run(rank: int) -> None:
        try:
            group = RankGroup(ThreadRank(collective, rank), on_timeout=lambda m: None)
            turn, n = turns[rank], len(turns[rank].prompt)
            out[rank] = group.start(lambda: chunks[rank], lambda c: turn, n, digests[rank])
        except Exception as exc:  # noqa: BLE001 -- reported by the test
            errors.append(exc)
            collective.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(turns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    agree.calls = getattr(collective, "calls", 0)
    return out


def test_ranks_restore_the_highest_position_every_rank_can_reach_in_one_exchange():
    # a state model: each rank lands only on its own snapshots; 32 is common to both
    a = TableTurn(60, reachable=[16, 32, 48])
    b = TableTurn(60, reachable=[32, 40])
    got = agree(a, b)
    assert [r.restored.position for r in got] == [32, 32]
    assert ("restore", 32) in a.calls and ("restore", 32) in b.calls
    assert agree.calls == 1  # chunk, request, repeat and positions: one gather
    assert [r.chunk for r in got] == [64, 64] and not any(r.short for r in got)


def test_the_deepest_common_position_of_three_ranks():
    a = TableTurn(100, reachable=[20, 50, 90])
    b = TableTurn(100, reachable=[20, 60, 95])
    c = TableTurn(100, reachable=[20, 55, 80])
    assert [r.restored.position for r in agree(a, b, c)] == [20, 20, 20]
    assert agree.calls == 1


def test_lists_that_share_nothing_within_their_length_fall_back_to_the_fixpoint():
    # each rank lists its 8 deepest positions; the only common one lies below both lists
    a = TableTurn(200, reachable=[8, *range(100, 180, 8)])
    b = TableTurn(200, reachable=[8, *range(101, 190, 8)])
    got = agree(a, b)
    assert [r.restored.position for r in got] == [8, 8]
    assert agree.calls > 1


def test_ranks_with_different_chunks_plan_again_under_the_smallest():
    a, b = TableTurn(60, reachable=[16, 48]), TableTurn(60, reachable=[16, 48])
    got = agree(a, b, chunks=[64, 32])
    assert [r.chunk for r in got] == [32, 32]
    assert [r.restored.position for r in got] == [48, 48]


def test_a_rank_that_lands_lower_says_so_and_keeps_the_agreed_shape():
    a = TableTurn(60, reachable=[16, 48])
    b = TableTurn(60, reachable=[16, 48], short={48: 16})  # its file at 48 is gone
    got = agree(a, b)
    # every rank prefills from 48 (the same pieces, so the same collectives); b's caches
    # hold 16 tokens, and the prefill's agreement voids the request (the executor)
    assert [r.restored.position for r in got] == [48, 48]
    assert [r.short for r in got] == [False, True]


def test_ranks_with_other_requests_are_out_of_step():
    with pytest.raises(RankError, match="out of step"):
        agree(TableTurn(30, [16]), TableTurn(30, [16]), digests=[1, 2])


def test_a_refusal_on_one_rank_refuses_on_every_rank():
    with pytest.raises(PrefillRefused):
        agree(TableTurn(30, [16]), TableTurn(30, [16]), chunks=[64, 0])


def test_the_same_prompt_again_is_taken_on_every_rank_or_on_none():
    both = agree(TableTurn(30, [16], repeat=True), TableTurn(30, [16], repeat=True))
    assert [r.restored.position for r in both] == [30, 30]
    a, b = TableTurn(30, [16], repeat=True), TableTurn(30, [16], repeat=False)
    assert [r.restored.position for r in agree(a, b)] == [16, 16]
    assert "decline" in a.calls  # a hands its resident back before restoring


def test_one_process_restores_the_request_alone_and_agrees_with_itself():
    turn = TableTurn(40, reachable=[16, 32])
    peers = OneProcess()
    agreed = peers.start(lambda: 64, lambda chunk: turn, 40, 7)
    assert agreed.restored.position == 40  # turn.restore() with no limit
    assert agreed.chunk == 64
    assert peers.all_min([3, 5]) == [3, 5]
    assert peers.agree_ok(0) == (0,)
    assert peers.on_every_rank("cleared hot") == "cleared hot"


# ------------------------------------------------------------------ the engine, one rank


class OneRankTransport:
    """``dist.Ranks`` for a group of one rank: every collective returns this rank's own
    values, so a :class:`RankGroup` over it runs the ranks' path in one process."""

    rank, size, is_main, group = 0, 1, True, None

    def __init__(self) -> None:
        self.failed, self.on_timeout, self.sent, self.shared = "", None, [], 0

    def section(self, stage: str):
        return contextlib.nullcontext()

    def tick(self) -> None:
        pass

    def broadcast(self, message=None):
        wire = json.loads(json.dumps(message))  # as the ranks send it: JSON bytes
        again = json.loads(json.dumps(actions.encode(actions.decode(wire))))
        assert again == wire  # the typed record round-trips
        self.sent.append(wire["op"])
        return message

    def all_min(self, values):
        return [values] if isinstance(values, int) else list(values)

    all_max = all_min

    def gather(self, row):
        return [list(row)]

    def sum_ints(self, x):
        return [int(v) for v in x.tolist()]

    def share_tokens(self, sampler):
        def shared(logprobs):
            self.shared += 1
            return sampler(logprobs)

        return shared


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_the_ranks_path_on_one_rank_equals_a_cold_run(arch, tmp_path, models_dir):
    """A shared prefix, a longer prompt and the same prompt again, through the ranks'
    path (the restore agreed through the request object), equal a cold engine's."""
    cold = make_engine(f"tiny:{arch}", tmp_path / "cold", models_dir, no_cache=True)
    transport = OneRankTransport()
    hot = Engine(
        Settings(
            bitwise=True,
            block_size=16,
            cache_dir=tmp_path / "kv",
            models_dir=models_dir,
            data_dir=tmp_path / "data",
        )
    )
    hot.peers = RankGroup(transport, on_timeout=lambda message: None)
    hot.record_logprobs = 3
    try:
        assert not hasattr(hot.load_model(f"tiny:{arch}").wait(120), "message")
        assert transport.sent == ["load"]
        base = random_prompt(50, seed=5)
        prompts = [base, base + random_prompt(23, seed=6), base + random_prompt(23, seed=6)]
        for i, p in enumerate(prompts):
            a, ha = generate(cold, p, max_tokens=5)
            b, hb = generate(hot, p, max_tokens=5)
            assert_same(a, ha, b, hb)
            if i == 1:
                assert b.metrics.cached_tokens > 0  # the shared prefix was restored
        assert b.metrics.cached_tokens >= len(prompts[2]) - 1  # the same prompt again
        assert hot.stats().ranks[0].cached_hot == b.metrics.cached_by["hot"]
        assert transport.sent.count("admit") == 3 and "decode" in transport.sent
        assert transport.shared > 0  # the batch's tokens went through the shared sampler
        assert "on each of 1 ranks" in hot.peers.on_every_rank("cleared")
    finally:
        hot.close()
        cold.close()


# ------------------------------------------------------------------ a short restore


class ShortOnce(OneProcess):
    """One process whose first restore of a cached prefix says it landed short, as a rank
    whose file vanished under its restore would (docs/DESIGN.md §19)."""

    def __init__(self) -> None:
        self.starts: list[tuple[bool, int]] = []

    def start(self, plan, open_turn, n, digest, cold=False):
        agreed = super().start(plan, open_turn, n, digest, cold)
        self.starts.append((cold, agreed.restored.position))
        if len(self.starts) == 1 and agreed.restored.position > 0:
            return agreed._replace(short=True)
        return agreed


@pytest.mark.parametrize("bitwise", [True, False])
def test_a_short_restore_stores_nothing_and_starts_the_request_again_cold(
    bitwise, tmp_path, models_dir
):
    """The prefill's agreement voids a request whose restore landed short on a rank: it
    starts again with no cache and equals a cold run (folded schedule: the first token from
    the prefill; bitwise: from the first decode step)."""
    cold = make_engine("tiny:llama", tmp_path / "cold", models_dir, no_cache=True)
    hot = make_engine("tiny:llama", tmp_path / "hot", models_dir, bitwise=bitwise)
    try:
        base = random_prompt(50, seed=5)
        generate(hot, base, max_tokens=3)
        hot.peers = peers = ShortOnce()
        longer = base + random_prompt(20, seed=6)
        a, ha = generate(cold, longer, max_tokens=5)
        b, hb = generate(hot, longer, max_tokens=5)
        assert [c for c, _ in peers.starts] == [False, True]
        assert peers.starts[0][1] > 0 and peers.starts[1][1] == 0
        assert b.metrics.cached_tokens == 0  # the second start restored nothing
        assert_same(a, ha, b, hb)
        assert any("starts again" in text for _, text in hot.stats().events)
    finally:
        hot.close()
        cold.close()
