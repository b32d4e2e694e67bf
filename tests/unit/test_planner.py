"""The restore planner on hand-filled tiers, with no model and no arrays: which position a
prompt restores to, from which blocks and which entry after them (docs/DESIGN.md §9).

The view is what :class:`~tierchat.core.cache.planner.Planner` reads of the prefix cache:
the block size, the root id, the leaves, where each chain block is held and the entries
after a block. Blocks here are 4 tokens; chain ids are "b0", "b1", ... in prompt order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierchat.core.cache.blocks import KIND_BLOCK, KIND_SEQ, KIND_TAIL
from tierchat.core.cache.layers import KIND_KV, KIND_STATE, make_leaf
from tierchat.core.cache.planner import Planner
from tierchat.core.cache.plans import Held
from tierchat.core.cache.schedule import schedule_points
from tierchat.core.cache.view import TierView

BS = 4
KV = [make_leaf("0", KIND_KV, "KVCache")]
HYBRID = [make_leaf("0", KIND_KV, "KVCache"), make_leaf("1", KIND_STATE, "ArraysCache")]


@dataclass
class After:
    """An entry after a block, as the planner sees one (the SSD tier's FileMeta shape)."""

    id: str
    start: int
    tokens: tuple[int, ...]
    kind: str = KIND_TAIL
    window: bool = True
    snapshot: bool = False


@dataclass
class View:
    """A :class:`~tierchat.core.cache.view.TierView` filled by hand."""

    leaves: list
    held_ids: dict[str, Held] = field(default_factory=dict)
    after: dict[str, list[After]] = field(default_factory=dict)
    block_size: int = BS
    root: str = "root"
    exact_prefix: bool = False
    state: list = field(default_factory=list)
    logprobs_spec: object = None

    def held(self, entry_id: str, use_ssd: bool = True) -> Held | None:
        h = self.held_ids.get(entry_id)
        return None if h is None or (h.source == "ssd" and not use_ssd) else h

    def children(self, parent: str, use_ssd: bool = True) -> list[After]:
        return list(self.after.get(parent, ()))

    def find(self, entry_id: str, use_ssd: bool = True) -> After | None:
        return next((t for ts in self.after.values() for t in ts if t.id == entry_id), None)


def test_the_hand_filled_view_is_a_tier_view():
    """The planner's seam is the protocol in the code; this view implements all of it."""
    view: TierView = View(KV)  # a type checker holds it to the protocol
    members = {"block_size", "root", "leaves", "state", "exact_prefix", "logprobs_spec"}
    members |= {"held", "children", "find"}
    assert all(hasattr(view, m) for m in members)
    assert set(TierView.__annotations__) | {"held", "children", "find"} <= members
    assert {m for m in vars(TierView) if not m.startswith("_")} <= members


PROMPT = tuple(range(100, 114))  # 14 tokens: blocks b0..b2 hold [0, 12), 2 tokens after
IDS = ["b0", "b1", "b2"]


def hot(snapshot: bool = False) -> Held:
    return Held("hot", True, snapshot)


def plan(view: View, prompt=PROMPT, **kw):
    points = schedule_points(len(prompt), 8, fold=False)  # [8, 13]
    return Planner(view).plan(prompt, IDS[: len(prompt) // BS], points, **kw)


def test_nothing_held_plans_nothing():
    assert plan(View(KV)) is None


def test_every_block_held_restores_the_chain_to_a_schedule_point_or_past_a_block():
    view = View(KV, {i: hot() for i in IDS})
    p = plan(view)
    # the bitwise schedule's points are 8 and 13; the chain reaches 12, more than a block
    # past 8 is not: the schedule point wins at equal speed
    assert p.position == 8 and p.blocks == (0, 1) and p.tail is None


def test_a_missing_middle_block_stops_the_chain_before_it():
    view = View(KV, {"b0": hot(), "b2": hot()})
    assert plan(view) is None or plan(view).position <= BS


def test_exact_prefix_goes_to_the_end_of_the_chain():
    view = View(KV, {i: hot() for i in IDS}, exact_prefix=True)
    p = plan(view)
    assert p.position == 12 and p.blocks == (0, 1, 2)


def test_a_tail_after_the_chain_extends_the_restore_to_where_an_earlier_sequence_stopped():
    tail = After("t", 12, PROMPT[12:13], kind=KIND_SEQ)  # an earlier prompt ended at 13
    view = View(KV, {i: hot() for i in IDS}, {"b2": [tail]})
    p = plan(view)
    assert p.position == 13 and p.tail is tail and p.tail_tokens == 1


def test_a_tail_that_differs_from_the_prompt_is_not_used():
    other = After("t", 12, (999,))
    view = View(KV, {i: hot() for i in IDS}, {"b2": [other]}, exact_prefix=True)
    assert plan(view).tail is None


def test_max_position_caps_the_plan():
    view = View(KV, {i: hot() for i in IDS}, exact_prefix=True)
    # whole blocks only past the cap's block boundary: no entry covers [4, 5)
    assert plan(view, max_position=5).position == BS
    assert plan(view, max_position=0) is None


def test_use_ssd_false_ignores_the_ssd_tier():
    view = View(KV, {"b0": hot(), "b1": Held("ssd", True, False), "b2": hot()}, exact_prefix=True)
    assert plan(view).position == 12
    assert plan(view, use_ssd=False).position == BS


def test_state_leaves_restore_only_where_a_snapshot_was_taken():
    # block b1 ends at 8 (a schedule point): its snapshot is needed there
    no_snap = View(HYBRID, {i: hot() for i in IDS}, state=HYBRID[1:])
    assert plan(no_snap) is None
    snap = View(HYBRID, {"b0": hot(), "b1": hot(snapshot=True), "b2": hot()}, state=HYBRID[1:])
    p = plan(snap)
    assert p.position == 8 and p.blocks == (0, 1)


def test_ties_between_tails_break_by_a_fixed_order():
    a = After("a", 12, PROMPT[12:13], kind=KIND_TAIL)
    b = After("b", 12, PROMPT[12:13], kind=KIND_TAIL)
    c = After("c", 12, PROMPT[12:13], kind=KIND_BLOCK)
    for order in ([a, b, c], [c, b, a], [b, c, a]):
        view = View(KV, {i: hot() for i in IDS}, {"b2": order}, exact_prefix=True)
        assert plan(view).tail.id == "b"  # the prompt tail with the highest id
