"""How a broken job names the ranks' failure (core/engine/distributed.py ``failure_of``):
a backend's collective error is a lost rank, in the README's words."""

from tierchat.core.engine.distributed import failure_of


def test_a_backends_error_is_a_lost_rank():
    why = failure_of(RuntimeError("[ring] connection to a peer was lost"))
    assert why.startswith("a rank was lost")


def test_any_other_error_leaves_the_ranks_out_of_step():
    why = failure_of(ValueError("shapes do not match"))
    assert why.startswith("the ranks are out of step") and "shapes" in why
    assert failure_of(RuntimeError("out of memory")).startswith("the ranks are out of step")
