"""Window layers: per-block K/V slices (what tierchat stores) vs per-block window snapshots.

Prefills a prompt in block-sized chunks on a sliding-window model and, at every block end,
takes both candidate payloads for each ``RotatingKVCache`` layer: the block's K/V slice,
and a snapshot of the whole rotating buffer. It then restores the last boundary both ways
into fresh caches, times it, and checks both give the cold run's next-token logits.

    python scripts/window_choice.py [--model demo-gemma] [--tokens 2048] [--block-size 256]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import tierchat.core  # noqa: F401  (OpenBLAS before mlx)
from tierchat.config.settings import Settings
from tierchat.core.cache import layers as L
from tierchat.core.models.loading import load_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo-gemma")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=256)
    args = ap.parse_args(argv)
    bs = args.block_size
    loaded = load_model(args.model, models_dir=Path(Settings().models_dir))
    model = loaded.model
    text = " ".join(f"line {i}: the harbour ledger lists ship {i * 7 % 97}." for i in range(2000))
    tokens = loaded.tokenizer.encode(text)[: args.tokens]
    n = (len(tokens) - 1) // bs * bs  # leave a next token to compare logits on

    caches = model.make_cache()
    leaves = L.classify(caches)
    window = [lf for lf in leaves if lf.kind == L.KIND_WINDOW]
    live = L.leaf_map(caches)
    slices = {lf.name: [] for lf in window}
    snap_bytes = slice_bytes = 0
    last_snap = {}
    for end in range(bs, n + 1, bs):
        model(mx.array(tokens[end - bs : end])[None], cache=caches)
        mx.eval([c.state for c in caches])
        for lf in window:
            c = live[lf.name]
            s = lf.capture(c, end - bs, end)
            snap = {
                "k": mx.contiguous(L._temporal(c, c.keys)),
                "v": mx.contiguous(L._temporal(c, c.values)),
            }
            mx.eval(list(s.values()) + list(snap.values()))
            slices[lf.name].append(s)
            slice_bytes += L.arrays_nbytes(s)
            snap_bytes += L.arrays_nbytes(snap)
            last_snap[lf.name] = snap

    def restore(kind: str) -> tuple[float, mx.array]:
        fresh = model.make_cache()
        fl = L.leaf_map(fresh)
        t0 = time.perf_counter()
        for lf in leaves:
            c, src = fl[lf.name], live[lf.name]
            if lf.kind == L.KIND_KV:
                # new array objects: the fresh cache's in-place updates must not reach src
                c.keys, c.values = src.keys[..., :n, :], src.values[..., :n, :]
                c.offset = n
            elif kind == "slices":
                first = max(0, n - lf.max_size) // bs
                lf.restore(c, slices[lf.name][first:], n)
            else:
                snap = last_snap[lf.name]
                c.keys, c.values = mx.array(snap["k"]), mx.array(snap["v"])
                c.offset, c._idx = n, snap["k"].shape[2]
        mx.eval([c.state for c in fresh if c is not None])
        dt = time.perf_counter() - t0
        out = model(mx.array(tokens[n : n + 1])[None], cache=fresh)[0, -1]
        mx.eval(out)
        return dt, out

    print(
        f"{args.model}: {len(window)} window layers (max_size {window[0].max_size}), "
        f"{n} tokens, block {bs}, {n // bs} blocks"
    )
    print(
        f"{'payload':<10}{'bytes/block':>14}{'total MB':>10}{'restore ms':>12}{'max |dlogit|':>14}"
    )
    results = {kind: restore(kind) for kind in ("slices", "snapshot")}
    cold = model(mx.array(tokens[n : n + 1])[None], cache=caches)[0, -1]
    mx.eval(cold)
    for kind, total in (("slices", slice_bytes), ("snapshot", snap_bytes)):
        dt, out = results[kind]
        diff = float(np.abs(np.array(out) - np.array(cold)).max())
        print(
            f"{kind:<10}{total // (n // bs):>14,}{total / 1e6:>10.1f}{dt * 1e3:>12.2f}{diff:>14.2e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
