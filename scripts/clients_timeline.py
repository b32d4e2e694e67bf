"""Many clients at once in process, with the engine's scheduler actions on a timeline
(docs/DESIGN.md §20): where `bench --serve --clients` measures through HTTP, this shows
what the engine did and when.

``--clients`` clients each send a prompt of a shared ``--system`` tokens plus their own
turn, all at once; each client sends its second turn (its prompt, its reply and new
tokens) as soon as its first reply ends, as the bench's clients do. Two rounds (a warm-up
with another system prompt, then the measured one). Prints, per request: when it was sent,
its first token, TTFT, the end and the tokens restored; then every scheduler action but
plain decode steps (``start``, ``group``, ``piece``; decode steps over 40 ms too) with its
time from the round's start and its duration (each action ends in an eval, so its time is
the device's), and the median decode step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tierchat.cli.common import start_engine
from tierchat.config.settings import load_settings
from tierchat.core.api import GenerateRequest, TokenBatch
from tierchat.core.engine import scheduler
from tierchat.core.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny:llama")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--system", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    actions: list[tuple[float, float, str, object, int, int, int]] = []
    t0 = [0.0]
    apply = scheduler.Scheduler._apply

    def timed(self, action: dict) -> None:
        start = time.perf_counter()
        apply(self, action)
        actions.append(
            (
                start - t0[0],
                time.perf_counter() - start,
                action["do"],
                action.get("uids", action.get("uid", "")),
                len(self.queued),
                len(self.prefilling),
                len(self.decoding),
            )
        )

    scheduler.Scheduler._apply = timed
    tmp = Path(tempfile.mkdtemp(prefix="tierchat-timeline-"))
    settings = load_settings({"model": args.model, "cache_dir": tmp / "kv", "data_dir": tmp})
    engine = start_engine(settings)
    vocab = engine.loaded.model.args.vocab_size
    rnd = random.Random(0)

    def tokens(k: int) -> tuple[int, ...]:
        return tuple(rnd.randrange(vocab // 2, vocab) for _ in range(k))

    def one_round(label: str) -> None:
        system = tokens(args.system)
        firsts = [system + tokens(100 + 6 * c) for c in range(args.clients)]
        seconds = [tokens(120 + 6 * c) for c in range(args.clients)]
        rows, go = [], threading.Event()

        def client(c: int) -> None:
            go.wait()
            prompt = firsts[c]
            for turn in range(2):
                sent = time.perf_counter() - t0[0]
                req = GenerateRequest(
                    sampling=SamplingParams(max_tokens=args.max_tokens),
                    prompt_ids=prompt,
                    boundaries=((args.system, "system"),),
                )
                handle = engine.submit(req)
                first = None
                for event in handle.events():
                    if first is None and isinstance(event, TokenBatch):
                        first = time.perf_counter() - t0[0]
                result = handle.wait(600)
                done = time.perf_counter() - t0[0]
                rows.append((c, turn, sent, first or done, done, result.metrics.cached_tokens))
                prompt = prompt + result.token_ids + seconds[c]

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for th in threads:
            th.start()
        actions.clear()
        t0[0] = time.perf_counter()
        go.set()
        for th in threads:
            th.join()
        print(f"== {label}")
        for c, turn, sent, first, done, cached in sorted(rows, key=lambda r: (r[1], r[3])):
            print(
                f"  client {c} turn {turn}: sent {sent:.3f} first {first:.3f} "
                f"ttft {first - sent:.3f} done {done:.2f} restored {cached}"
            )
        steps = []
        for at, took, do, uids, queued, prefilling, decoding in actions:
            if do == "decode":
                steps.append(took)
            if do != "decode" or took > 0.04:
                print(
                    f"  {at:7.3f} +{1000 * took:6.1f} ms {do:6s} {uids} "
                    f"queued {queued} prefill {prefilling} decoding {decoding}"
                )
        if steps:
            print(f"  {len(steps)} decode steps, median {1000 * statistics.median(steps):.1f} ms")

    try:
        one_round("warm-up")
        one_round("measured")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
