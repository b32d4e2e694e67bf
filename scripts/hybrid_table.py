"""Tokens prefilled per chat operation: tierchat vs cold vs mlx-lm's LRUPromptCache.

For each model (default: every tiny architecture) one scripted conversation runs through
tierchat's engine (``ChatSession``); every prompt it produced is then replayed cold (same
engine, ``use_cache=False``) and through mlx-lm's ``LRUPromptCache`` the way
``mlx_lm/server.py`` uses it: ``fetch_nearest_cache``, prefill with a checkpoint inserted
at the end of every system/user segment, decode, ``insert_cache`` of prompt + reply. mlx-lm
has no disk tier, so at ``restart`` and ``clear hot`` its cache starts empty.

    python scripts/hybrid_table.py [--models tiny:llama,tiny:mamba2] [--block-size 16]
                                   [--repeat N] [--json-out FILE]

Prints one table per model (prefilled tokens and TTFT / cold TTFT per operation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import tierchat.core  # noqa: F401  (OpenBLAS before mlx)
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import LRUPromptCache
from tierchat.config.settings import Settings
from tierchat.core.api import GenerateRequest
from tierchat.core.chat.session import ChatSession
from tierchat.core.chat.store import ConversationStore
from tierchat.core.engine.engine import Engine
from tierchat.core.models.tiny import TINY_ARCHS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_script import SCRIPT, SYSTEM, USERS, mlx_lm_prefill, play  # noqa: E402  (one script dir)
from tierchat.core.chat.conversation_settings import ConversationSettings
from tierchat.core.sampling_params import SamplingParams


def run_ours(model: str, tmp: Path, block_size: int, max_tokens: int, repeat: int = 1):
    settings = Settings(
        block_size=block_size,
        cache_dir=tmp / "kv",
        models_dir=tmp / "models",
        data_dir=tmp / "data",
        hot_bytes=1 << 30,
        ssd_bytes=1 << 30,
    )

    def start():
        e = Engine(settings)
        loaded = e.load_model(model).wait(600)
        if not hasattr(loaded, "model"):
            sys.exit(f"error: {loaded.message}")
        return e

    session = ChatSession(
        start(),
        ConversationStore(tmp / "chat.sqlite"),
        ConversationSettings(sampling=SamplingParams(max_tokens=max_tokens), swipe_temperature=0.0),
    )
    session.new_conversation(SYSTEM)
    script = [tuple(x * repeat if x in USERS else x for x in op) for op in SCRIPT]
    rows = []
    for name, turn, res in play(session, script, start):
        rows.append(
            dict(
                op=name,
                prompt=turn.prompt.token_ids,
                boundaries=turn.prompt.boundaries,
                reply=res.token_ids,
                ours_prefill=res.metrics.prefill_tokens,
                ours_ttft=res.metrics.ttft_s,
            )
        )
    engine = session.engine
    # cold TTFT of each prompt, same engine and chunking
    for row in rows:
        h = engine.submit(
            GenerateRequest(
                sampling=SamplingParams(max_tokens=1), prompt_ids=row["prompt"], use_cache=False
            )
        )
        row["cold_ttft"] = h.wait(600).metrics.ttft_s
    model_dir = engine.loaded.model_dir
    engine.close()
    return rows, model_dir


def run_mlx_lm(rows, model_dir: Path):
    """mlx-lm's server flow over the same prompts (main thread, its own model copy)."""
    from tierchat.core.models.loading import load_model

    loaded = load_model(str(model_dir))
    model = loaded.model
    lru = LRUPromptCache(max_size=10)
    for row in rows:
        if row["op"].startswith(("restart", "clear_hot")):
            lru = LRUPromptCache(max_size=10)
        prompt, boundaries = list(row["prompt"]), row["boundaries"]
        t0 = time.perf_counter()
        cache, start = mlx_lm_prefill(lru, model, prompt, boundaries)
        ttft = None
        gen = []
        for tok, _ in generate_step(
            mx.array(prompt[-1:]), model, prompt_cache=cache, max_tokens=len(row["reply"])
        ):
            if ttft is None:
                ttft = time.perf_counter() - t0
            gen.append(tok)
        mx.eval([c.state for c in cache])
        lru.insert_cache("m", prompt + gen, cache, cache_type="assistant")
        row["mlx_prefill"] = len(prompt) - start
        row["mlx_ttft"] = ttft


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(f"tiny:{a}" for a in TINY_ARCHS))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1, help="repeat each user message N times")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    report = {}
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory() as d:
            rows, model_dir = run_ours(
                model, Path(d), args.block_size, args.max_tokens, args.repeat
            )
            run_mlx_lm(rows, model_dir)
        print(f"\n{model} (block {args.block_size})")
        print(
            f"{'op':<15}{'prompt':>7}{'cold':>7}{'ours':>7}{'mlx-lm':>8}{'ours TTFT/cold':>16}{'mlx-lm TTFT/cold':>18}"
        )
        for r in rows:
            print(
                f"{r['op']:<15}{len(r['prompt']):>7}{len(r['prompt']):>7}{r['ours_prefill']:>7}"
                f"{r['mlx_prefill']:>8}{r['ours_ttft'] / r['cold_ttft']:>16.3f}"
                f"{r['mlx_ttft'] / r['cold_ttft']:>18.3f}"
            )
        tot = {k: sum(r[k] for r in rows) for k in ("ours_prefill", "mlx_prefill")}
        cold = sum(len(r["prompt"]) for r in rows)
        med = {
            k: statistics.median(r[k] / r["cold_ttft"] for r in rows)
            for k in ("ours_ttft", "mlx_ttft")
        }
        print(
            f"{'total':<15}{'':>7}{cold:>7}{tot['ours_prefill']:>7}{tot['mlx_prefill']:>8}"
            f"{med['ours_ttft']:>16.3f}{med['mlx_ttft']:>18.3f}   (TTFT columns: medians)"
        )
        report[model] = [
            {
                k: (v if not isinstance(v, tuple) else len(v))
                for k, v in r.items()
                if k != "boundaries"
            }
            for r in rows
        ]
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
