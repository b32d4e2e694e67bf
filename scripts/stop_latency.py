"""How soon a stop during a long prefill frees the engine (docs/DESIGN.md §20).

Loads ``--model`` (default ``demo``) with the settings in force, sends a prompt of
``--tokens`` tokens, cancels it ``--after`` seconds into its prefill, and prints the time
from the cancel to the next request's first event (a 3-token prompt queued behind it), the
tokens kept, and what a retry of the same prompt restores. One run, printed as one line.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

from tierchat.cli.common import start_engine
from tierchat.config.settings import load_settings
from tierchat.core.api import Failed, GenerateRequest, PrefillProgress
from tierchat.core.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--after", type=float, default=4.0)
    args = ap.parse_args()
    cache_dir = tempfile.mkdtemp(prefix="tierchat-stop-")  # a cold cache of its own
    settings = load_settings({"model": args.model, "cache_dir": cache_dir})
    engine = start_engine(settings)
    try:
        started = threading.Event()
        prompt = tuple(1000 + (i * 7919) % 20000 for i in range(args.tokens))

        def on_event(event) -> None:
            if isinstance(event, PrefillProgress):
                started.set()

        engine.clear("all")
        t0 = time.perf_counter()
        long = engine.submit(
            GenerateRequest(sampling=SamplingParams(max_tokens=4), prompt_ids=prompt), on_event
        )
        started.wait(600)
        time.sleep(args.after)
        next_started = threading.Event()
        short = engine.submit(
            GenerateRequest(sampling=SamplingParams(max_tokens=2), prompt_ids=(11, 12, 13)),
            lambda e: next_started.set(),
        )
        t_cancel = time.perf_counter()
        long.cancel()
        next_started.wait(600)
        freed_s = time.perf_counter() - t_cancel
        result = long.wait(600)
        short.wait(600)
        kept = result.kept_tokens if isinstance(result, Failed) else -1
        retry = engine.submit(
            GenerateRequest(sampling=SamplingParams(max_tokens=2), prompt_ids=prompt)
        )
        retry.wait(3600)
        print(
            f"{args.model}: {args.tokens}-token prompt cancelled {t_cancel - t0:.1f} s in: "
            f"next request started {freed_s:.2f} s after the cancel; kept {kept} tokens; "
            f"the retry restored {retry.trace.restored_position} of {args.tokens} "
            f"(prefill_step {engine.runtime.plan.step}, {engine.stats().last_turn.prefill_tps:.0f} tok/s)",
            flush=True,
        )
    finally:
        engine.close()


if __name__ == "__main__":
    main()
