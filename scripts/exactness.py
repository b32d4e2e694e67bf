"""How far each cached chat operation is from a cold run, by teacher forcing.

One scripted conversation (``chat_script.SCRIPT``: append, regenerate twice, swipe + append,
edit the first turn, append, edit the last turn, restart + append, clear hot + append,
regenerate) runs through tierchat's engine with its cache on (``ChatSession``, greedy,
``--tokens`` per reply). For every operation, the reply's
tokens are then fed, one decode step each, to a cold run of the same prompt (a no-cache
engine, ``GenerateRequest.teacher_ids``) and to mlx-lm's ``LRUPromptCache`` used as
``mlx_lm/server.py`` uses it (nearest cache, checkpoints at system/user ends, prompt + reply
inserted; it has no disk tier, so it starts empty after a restart or a cleared hot tier).
Printed per operation and system, against the cold run over the same tokens:

- top-1: positions whose argmax equals the cold run's, of ``--tokens``;
- max |dlogprob|: the largest absolute difference of any log-probability at any position;
- first: the first position whose argmax differs (- if none); bitwise: every vector equal.

    python scripts/exactness.py --model shape:qwen2.5-0.5b [--tokens 64] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import tierchat.core  # noqa: F401  (OpenBLAS before mlx)
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import LRUPromptCache
from tierchat.config.settings import Settings
from tierchat.core.api import Finished, GenerateRequest
from tierchat.core.chat.session import ChatSession
from tierchat.core.chat.store import ConversationStore
from tierchat.core.engine.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_script import SCRIPT, SYSTEM, mlx_lm_prefill, play  # noqa: E402  (one script dir)
from tierchat.core.chat.conversation_settings import ConversationSettings
from tierchat.core.sampling_params import SamplingParams


def compare(ref: list[np.ndarray], got: list[np.ndarray]) -> dict:
    n = min(len(ref), len(got))
    top = [int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(ref[:n], got[:n], strict=True)]
    diff = max(
        (float(np.abs(a - b).max()) for a, b in zip(ref[:n], got[:n], strict=True)), default=0.0
    )
    first = next((i for i, ok in enumerate(top) if not ok), None)
    bitwise = all(np.array_equal(a, b) for a, b in zip(ref[:n], got[:n], strict=True))
    return {"top1": sum(top), "n": n, "max_dlogprob": diff, "first": first, "bitwise": bitwise}


def run_ours(args, tmp: Path) -> list[dict]:
    settings = Settings(
        model=args.model, block_size=args.block_size, cache_dir=tmp / "kv",
        models_dir=Path(args.models_dir or tmp / "models"), data_dir=tmp / "data",
        hot_bytes=4 << 30, ssd_bytes=8 << 30,
    )  # fmt: skip

    def start(**kw) -> Engine:
        e = Engine(Settings(**{**settings.__dict__, **kw}))
        loaded = e.load_model(args.model).wait(900)
        if not hasattr(loaded, "model") or getattr(loaded, "message", None):
            sys.exit(f"error: {getattr(loaded, 'message', loaded)}")
        e.record_logprobs = args.tokens
        return e

    engine, cold = start(), start(no_cache=True, cache_dir=tmp / "cold")
    session = ChatSession(
        engine,
        ConversationStore(tmp / "chat.sqlite"),
        ConversationSettings(
            sampling=SamplingParams(max_tokens=args.tokens), swipe_temperature=0.0
        ),
    )
    session.new_conversation(SYSTEM)
    rows = []
    for name, turn, res in play(session, SCRIPT, start, timeout=900):
        reply = res.token_ids
        ref = cold.submit(GenerateRequest(prompt_ids=turn.prompt.token_ids, teacher_ids=reply))
        done = ref.wait(900)
        assert isinstance(done, Finished), done
        rows.append(
            dict(
                op=name, prompt=turn.prompt.token_ids, boundaries=turn.prompt.boundaries,
                reply=reply, cold=ref.trace.logprobs, cached=res.metrics.cached_tokens,
                ours=compare(ref.trace.logprobs, turn.request_handle.trace.logprobs),
            )
        )  # fmt: skip
    session.engine.close()
    cold.close()
    return rows


def run_mlx_lm(args, rows: list[dict]) -> None:
    """mlx-lm's server flow over the same prompts and forced replies (its own model copy)."""
    from tierchat.core.models.loading import load_model

    model = load_model(
        args.model, models_dir=Path(args.models_dir) if args.models_dir else None
    ).model
    lru = LRUPromptCache(max_size=10)
    for row in rows:
        if row["op"].startswith(("restart", "clear_hot")):
            lru = LRUPromptCache(max_size=10)
        prompt, boundaries = list(row["prompt"]), row["boundaries"]
        cache, start = mlx_lm_prefill(lru, model, prompt, boundaries)
        forced = iter(row["reply"])
        got = []
        for _tok, lp in generate_step(
            mx.array(prompt[-1:]), model, prompt_cache=cache, max_tokens=len(row["reply"]),
            sampler=lambda logprobs, forced=forced: mx.array([next(forced, 0)]),
        ):  # fmt: skip
            got.append(np.array(lp.astype(mx.float32)))
        mx.eval([c.state for c in cache])
        lru.insert_cache("m", prompt + list(row["reply"]), cache, cache_type="assistant")
        row["mlx_cached"] = start
        row["mlx"] = compare(row["cold"], got)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:llama")
    ap.add_argument("--models-dir")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        rows = run_ours(args, Path(d))
        run_mlx_lm(args, rows)
    from tierchat.core.device import describe_device

    print(f"{args.model} · {describe_device()} · teacher forcing over {args.tokens} tokens")
    head = f"{'op':<17}{'prompt':>7} | {'cached':>7}{'top-1':>7}{'max|dlp|':>10}{'first':>6}{'bitwise':>8} |"
    print(head + f" {'cached':>7}{'top-1':>7}{'max|dlp|':>10}{'first':>6}{'bitwise':>8}")
    print(f"{'':<17}{'':>7} | {'tierchat':^38} | {'mlx-lm LRUPromptCache':^38}")
    out = []
    for r in rows:
        line = f"{r['op']:<17}{len(r['prompt']):>7}"
        for cached, c in ((r["cached"], r["ours"]), (r["mlx_cached"], r["mlx"])):
            first = "-" if c["first"] is None else str(c["first"])
            line += (
                f" | {cached:>7}{c['top1']:>4}/{c['n']:<2}{c['max_dlogprob']:>10.2e}{first:>6}"
                f"{'yes' if c['bitwise'] else 'no':>8}"
            )
        print(line)
        out.append(
            {k: v for k, v in r.items() if k in ("op", "cached", "mlx_cached", "ours", "mlx")}
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
