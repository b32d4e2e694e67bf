"""The ranks' agreement on a request, and what a failed rank may store (docs/DESIGN.md §19).

2 ranks over MLX's ring backend on this machine (``tests/rank_kit.py``), rank 0 a driver
script on the engine, rank 1 tierchat's worker:

- the collectives tierchat makes per request (messages and agreements, outside the
  model's own forward and the shared tokens), counted by a wrapper around the ranks'
  operations: one a message (two for a long prompt's), and two agreements a request (its
  start's one exchange; its prefill's success, with the first token), restored from the
  hot tier or not;
- a rank whose prefill fails: the request fails on rank 0 with a clear error, no rank
  stores its entries, and the next request works and equals a cold run.
"""

from __future__ import annotations

import json

import pytest
from rank_kit import start_ranks

COUNT_DRIVER = """
import json, sys
from tierchat.config.settings import Settings
from tierchat.core.engine import distributed as dist
from tierchat.core.api import Failed, GenerateRequest
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.engine.engine import Engine

cache_dir, models_dir = sys.argv[1], sys.argv[2]
from tierchat.core.engine.ranks import RankGroup
counts = {"messages": 0, "message_syncs": 0, "agreements": 0, "stats": 0}
where = []
def context(cls, name, kind):  # collectives inside it count as ``kind``
    op = getattr(cls, name)
    def wrapped(self, *args, **kwargs):
        counts["messages"] += name == "broadcast"
        where.append(kind)
        try:
            return op(self, *args, **kwargs)
        finally:
            where.pop()
    setattr(cls, name, wrapped)
def collective(name):
    op = getattr(dist.Ranks, name)
    def wrapped(self, *args, **kwargs):
        counts[where[-1] if where else "agreements"] += 1
        return op(self, *args, **kwargs)
    setattr(dist.Ranks, name, wrapped)
# every collective tierchat evaluates outside the model's forward and the shared tokens
# (a message's, the stats' and the agreements'): this rank's calls, which every rank
# makes alike
context(dist.Ranks, "broadcast", "message_syncs")
context(RankGroup, "gather_stats", "stats")
for name in ("_sum", "all_min", "all_max"):
    collective(name)

s = Settings(model="tiny:llama", cache_dir=cache_dir, models_dir=models_dir, block_size=16,
             prefill_chunk=256)
e = Engine(s)
assert not isinstance(e.load_model("tiny:llama").wait(), Failed)
base = tuple(range(3, 60))
out = {}
def run(name, req):
    before = dict(counts)
    r = e.submit(req).wait(120)
    assert not isinstance(r, Failed), r
    out[name] = {k: counts[k] - before[k] for k in counts}
    out[name]["cached"] = r.metrics.cached_tokens
    out[name]["tokens"] = list(r.token_ids)
four = SamplingParams(max_tokens=4)
run("cold", GenerateRequest(base, four, use_cache=False))
run("first", GenerateRequest(base, four))
run("cached", GenerateRequest(base + (7, 8, 9, 10, 11), four))
run("cached_off", GenerateRequest(base + (7, 8, 9, 10, 11), four, use_cache=False))
run("long", GenerateRequest(tuple(range(3, 240)) * 2, four, use_cache=False))  # a 2 KB admit
e.close()
dist.current().broadcast({"op": "exit"})
print(json.dumps(out))
"""


def _drive(tmp_path, models_dir, driver: str, **env) -> dict:
    path = tmp_path / "driver.py"
    path.write_text(driver)
    kv = tmp_path / "kv"
    worker = ["cache", "stats", "--block-size", "16", "--prefill-chunk", "256"]
    worker += ["--cache-dir", str(kv), "--models-dir", str(models_dir)]
    ranks = start_ranks(worker, tmp_path, rank0=[str(path), str(kv), str(models_dir)], **env)
    try:
        (code0, out0, err0), (code1, out1, err1) = ranks.wait()
    finally:
        ranks.kill()
    assert (code0, code1) == (0, 0), (err0, err1)
    assert "Traceback" not in err0 + err1, (err0, err1)
    return {"out": json.loads(out0.strip().splitlines()[-1]), "err1": err1, "out1": out1}


def test_a_request_costs_one_collective_a_message_and_two_agreements(tmp_path, models_dir):
    out = _drive(tmp_path, models_dir, COUNT_DRIVER)["out"]
    print("collectives per request:", json.dumps(out))
    cached, off = out["cached"], out["cached_off"]
    assert cached["cached"] > 0 and off["cached"] == 0
    assert cached["tokens"] == off["tokens"]
    long = out.pop("long")
    for req in out.values():
        assert req["message_syncs"] == req["messages"]  # one collective a message
        assert req["stats"] == 1  # the stats, gathered at the end
    assert long["message_syncs"] == long["messages"] + 1  # the admit's rest: a second one
    # the start's one exchange, and the prefill's success in the all_sum of its first token
    # (made before too, inside the graph): one collective more than one rank alone
    assert cached["agreements"] == off["agreements"] == 2


FAULT_DRIVER = """
import json, sys
from tierchat.config.settings import Settings
from tierchat.core.engine import distributed as dist
from tierchat.core.api import Failed, GenerateRequest
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.engine.engine import Engine

cache_dir, models_dir = sys.argv[1], sys.argv[2]
s = Settings(model="tiny:llama", cache_dir=cache_dir, models_dir=models_dir, block_size=16,
             prefill_chunk=256)
e = Engine(s)
assert not isinstance(e.load_model("tiny:llama").wait(), Failed)
prompt, four = tuple(range(3, 60)), SamplingParams(max_tokens=4)
out = {}
def run(name, req):
    r = e.submit(req).wait(120)
    ranks = e.stats().ranks
    out[name] = {"type": type(r).__name__, "message": getattr(r, "message", ""),
                 "tokens": list(getattr(r, "token_ids", ())),
                 "cached": getattr(getattr(r, "metrics", None), "cached_tokens", 0),
                 "entries": [(x.hot_entries, x.ssd_entries) for x in ranks]}
run("failed", GenerateRequest(prompt, four))  # the fault: one rank's first piece
run("after", GenerateRequest(prompt, four))
run("again", GenerateRequest(prompt, four))
run("cold", GenerateRequest(prompt, four, use_cache=False))
e.close()
dist.current().broadcast({"op": "exit"})
print(json.dumps(out))
"""


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_whose_prefill_fails_stores_nothing_and_the_next_request_works(
    tmp_path, models_dir, rank
):
    """The first prefill piece's capture raises on one rank (a test fault): the request
    fails on rank 0 naming that rank, no rank holds an entry of it, and the same prompt
    next is computed again (nothing to restore), equal to a cold run, and then cached."""
    got = _drive(tmp_path, models_dir, FAULT_DRIVER, TIERCHAT_TEST_FAIL_PREFILL=f"{rank}:1")
    out = got["out"]
    failed = out["failed"]
    assert failed["type"] == "Failed", failed
    assert f"the prefill failed on rank {rank}" in failed["message"]
    assert "nothing of it was cached" in failed["message"]
    assert failed["entries"] == [[0, 0], [0, 0]]  # neither rank stored any of it
    after, cold = out["after"], out["cold"]
    assert after["type"] == "Finished" and after["cached"] == 0
    assert after["tokens"] == cold["tokens"]
    assert out["again"]["cached"] > 0 and out["again"]["tokens"] == cold["tokens"]
    assert all(hot > 0 for hot, _ in out["after"]["entries"])
