"""The prefill forward cost model (core/engine/forward_cost.py) and how the scheduler sizes
pieces and groups with it: a GPU's per-forward floor must not read as a low rate."""

from __future__ import annotations

import types

import pytest
from tierchat.core.engine.forward_cost import DECAY, ForwardCost
from tierchat.core.engine.scheduler import LONE_PIECE_S, Scheduler

FLOOR, RATE = 0.035, 30_000.0  # an 8B model on a GPU, roughly: 35 ms + 30K tokens/s


def _measured(*sizes: int) -> ForwardCost:
    cost = ForwardCost()
    for n in sizes:
        cost.add(n, FLOOR + n / RATE)
    return cost


def test_nothing_measured_is_unknown():
    cost = ForwardCost()
    assert cost.tokens_in(0.25) is None
    assert cost.rate == 0 and cost.floor == 0
    cost.add(0, 0.1)
    cost.add(10, 0.0)
    assert cost.tokens_in(0.25) is None  # non-positive forwards are ignored


def test_the_line_through_small_and_large_forwards_is_found():
    """Forwards of 25, 256 and 2048 tokens on ``35 ms + n / 30K``: the fit gives the floor
    and the marginal rate, where the mean tokens/s of the pieces reads under a third of it."""
    cost = _measured(25, 256, 25, 2048, 256, 25)
    assert cost.floor == pytest.approx(FLOOR, rel=1e-6)
    assert cost.rate == pytest.approx(RATE, rel=1e-6)
    assert cost.tokens_in(0.25) == pytest.approx((0.25 - FLOOR) * RATE, abs=1)
    assert cost.tokens_in(0.01) == 1  # under the floor: the smallest forward
    naive = sum(n / (FLOOR + n / RATE) for n in (25, 256, 2048)) / 3
    assert naive < RATE / 3


def test_alike_sizes_or_a_falling_slope_fall_back_to_the_mean_ratio():
    cost = _measured(256, 256, 256)  # no spread: no slope to fit
    assert cost.floor == 0
    assert cost.rate == pytest.approx(256 / (FLOOR + 256 / RATE))
    noisy = ForwardCost()
    noisy.add(100, 0.2)
    noisy.add(1000, 0.1)  # larger and faster: noise, not a line
    assert noisy.floor == 0
    older = DECAY  # the earlier forward's weight
    assert noisy.rate == pytest.approx((older * 100 + 1000) / (older * 0.2 + 0.1))


def test_the_fit_follows_the_device_as_it_changes():
    """Old forwards fade: after the rate halves (a longer context), a few forwards move
    the fit most of the way there."""
    cost = _measured(25, 2048, 256, 25, 2048, 256)
    for n in (25, 2048, 256, 25, 2048, 256, 25, 2048, 256, 25, 2048, 256):
        cost.add(n, FLOOR + n / (RATE / 2))
    assert cost.rate == pytest.approx(RATE / 2, rel=0.1)


class _Prefill:
    """What the scheduler asks of a prefill when sizing its next piece or a group."""

    def __init__(self, left: int) -> None:
        self.pos, self.n, self.chunk = 0, left, 2048
        self.budgets: list[tuple[int | None, bool]] = []

    def next_end(self, budget: int | None = None, lone: bool = False) -> int:
        self.budgets.append((budget, lone))
        return self.pos + min(self.n, budget or self.n)


def _view(prefill_step: int = 0) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        queued=[],
        prefilling=[],
        decoding={},
        cache=types.SimpleNamespace(prefill_rate=0.0, block_size=16, state=False),
        prefill_step=prefill_step,
        block_size=16,
    )


def _request(p: _Prefill) -> types.SimpleNamespace:
    return types.SimpleNamespace(uid=1, params=None, prefill=p, cancelled=False)


def test_a_piece_while_others_decode_gets_what_fits_by_the_fitted_line():
    """With seven requests decoding, a 300-token second turn's piece: after tiny rests and
    block pieces were measured, the fitted line fits the whole turn in the step's time
    (the mean tokens/s of those pieces would have cut it into blocks)."""
    sched = Scheduler(prefill_chunk=2048, bitwise=False, cost=_measured(25, 256, 25, 2048, 25, 256))
    view = _view()
    view.decoding = {k: object() for k in range(7)}
    p = _Prefill(300)
    assert sched.piece_end(view, _request(p), 0.25) == 300
    [(budget, lone)] = p.budgets
    # (0.25 - FLOOR) * RATE = 6,450 tokens: the size at or below it (384 blocks)
    assert budget == 6144 and not lone
    sched.piece_end(view, _request(p), 0.0)  # the step's time spent: still 50 ms of work
    # (0.05 - FLOOR) * RATE = 450 tokens, under the floor: a forward's fixed 35 ms is
    # worth 1,050 tokens, and the size that holds them is 1,536
    assert p.budgets[-1][0] == 1536


def test_a_lone_piece_takes_the_larger_of_the_fit_and_the_kept_rate():
    sched = Scheduler(prefill_chunk=2048, bitwise=False)
    view = _view(prefill_step=64)
    p = _Prefill(100_000)
    sched.piece_end(view, _request(p), 0.25)
    assert p.budgets[-1] == (None, False)  # nothing known: the schedule's next cut
    view.cache.prefill_rate = 10_000.0
    sched.piece_end(view, _request(p), 0.25)
    assert p.budgets[-1] == (4096, True)  # 5,000 tokens of the kept rate: the size below
    assert 4096 <= 10_000 * LONE_PIECE_S
    sched.cost = _measured(25, 256, 2048)
    sched.piece_end(view, _request(p), 0.25)
    budget, lone = p.budgets[-1]
    assert budget == 12288 and lone  # (LONE_PIECE_S - FLOOR) * RATE = 13,950: the size below
