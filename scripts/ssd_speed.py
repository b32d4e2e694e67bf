"""SSD restore speed against the disk's own sequential read bandwidth, in one run.

Writes ``--entries`` entries of a realistic size (``--layers`` layers of bf16 K/V slices
``(1, --heads, --tokens, --head-dim)``: 24 x 256 x 2 x 64 is one 256-token block of
Qwen2.5-0.5B, 3 MiB; 512 of them are a 128K-token prefix, 1.5 GiB) plus ``--big`` entries
of about 16 MiB, through ``SSDTier.put``. Before each mode of a round it measures the raw
sequential read of the same files (:func:`measure_read_bandwidth`, a ``dd``-like loop);
the page cache of those files is dropped (``posix_fadvise(DONTNEED)``) before every read,
so both compare like with like. Each mode runs on a fresh tier (index rebuilt from
headers):

- ``load``: ``SSDTier.load`` of every entry, one after the other;
- ``prefetch + load``: the same after ``POSIX_FADV_WILLNEED`` of every file;
- ``read ahead + load``: ``SSDReader.read_ahead`` of every file, then the loads (the reads
  of a restore, without its fill);
- ``restore (concatenate)``: read ahead, loads, then one concatenate per K/V array into
  ``KVCache`` objects (``KVLeaf.restore``: the fill before the streamed fill);
- ``restore (streamed)``: read ahead, each loaded entry copied into the cache's buffers as
  it comes (``StreamedFill``, what ``Restorer`` does for a plan that reads the SSD tier),
  buffers with room for ``--rest`` more tokens and one.

After each restore mode, the write of a ``--rest``-token chunk into the restored caches is
timed apart (``KVCache.update_and_fetch``: a copy of the whole cache where it must grow).

Prints each against the raw read, with the CPU seconds per GB of the process (all
threads: a figure that other jobs on the machine move less than the wall clock), and the
median ratio per mode (the restore's goal:
>= 0.80 at 32K-128K tokens, docs/DESIGN.md §8.4), each against the raw read made just
before it, as the disk's own speed moves over a run.

    python scripts/ssd_speed.py [--dir DIR] [--entries 32] [--big 4] [--rounds 3]
        [--modes "read ahead + load,restore (concatenate),restore (streamed)"] [--rest 512] [--mlx-cache BYTES]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from tierchat.core.cache.blocks import KIND_BLOCK, Entry, chain_ids, root_id
from tierchat.core.cache.fill import StreamedFill
from tierchat.core.cache.layers import KVLeaf
from tierchat.core.cache.ssd.io import drop_page_cache, measure_read_bandwidth
from tierchat.core.cache.ssd.tier import SSDTier

FP = "5d" * 32


class _Tier(SSDTier):
    verify_at_start = False  # the start-up verifier would read the files we time


def make_entry(i: int, layers: int, heads: int, tokens: int, head_dim: int) -> Entry:
    toks = tuple((i * 7919 + t) % 50000 for t in range(tokens))
    parent = root_id(FP)
    arrays = {}
    key = mx.random.key(i)
    for layer in range(layers):
        for part in "kv":
            key, sub = mx.random.split(key)
            shape = (1, heads, tokens, head_dim)
            arrays[f"{layer}.{part}"] = mx.random.normal(shape, key=sub).astype(mx.bfloat16)
    mx.eval(list(arrays.values()))
    e = Entry(
        id=chain_ids(parent, toks, tokens, 1)[0],
        parent=parent,
        kind=KIND_BLOCK,
        start=0,
        tokens=toks,
        role="user",
        arrays=arrays,
    )
    e.nbytes = sum(a.nbytes for a in arrays.values())
    return e


def _cpu_s() -> float:
    """CPU seconds of this process so far, every thread's (reader threads and MLX's too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _loads(tier: SSDTier, ids: list[str]) -> list[Entry]:
    out = [tier.load(i) for i in ids]
    assert all(e is not None for e in out), "entry failed to load"
    return out


def _load(tier, ids, leaves, tokens, rest) -> None:
    _loads(tier, ids)


def _prefetch_load(tier, ids, leaves, tokens, rest) -> None:
    tier.reader.prefetch(ids)
    _loads(tier, ids)


def _ahead_load(tier, ids, leaves, tokens, rest) -> None:
    tier.reader.read_ahead(ids)
    _loads(tier, ids)


def _restore_concatenate(tier, ids, leaves, tokens, rest) -> list[KVCache]:
    tier.reader.read_ahead(ids)
    entries = _loads(tier, ids)
    caches = [KVCache() for _ in leaves]
    for leaf, c in zip(leaves, caches, strict=True):
        parts = [{p: e.arrays[f"{leaf.name}.{p}"] for p in "kv"} for e in entries]
        leaf.restore(c, parts, tokens * len(ids))
    mx.eval([c.state for c in caches])
    return caches


def _restore_streamed(tier, ids, leaves, tokens, rest) -> list[KVCache]:
    tier.reader.read_ahead(ids)
    # room for the prompt's rest and a first decoded token, as Restorer makes it
    fill = StreamedFill(leaves, tokens * len(ids), length=tokens * len(ids) + rest + 1)
    for i in ids:
        e = tier.load(i)
        assert e is not None, "entry failed to load"
        fill.add(e, tokens)
    caches = [KVCache() for _ in leaves]
    for leaf, c in zip(leaves, caches, strict=True):
        fill.adopt(leaf, c)
    mx.eval([c.state for c in caches])
    return caches


def _first_chunk_s(caches: list[KVCache], rest: int) -> float:
    """Seconds to write the K/V of a ``rest``-token chunk into every restored cache (the
    first prefill chunk's cache update, without its forward)."""
    k = mx.zeros(caches[0].keys.shape[:2] + (rest, caches[0].keys.shape[3]), caches[0].keys.dtype)
    mx.eval(k)
    t0 = time.perf_counter()
    mx.eval([c.update_and_fetch(k, k) for c in caches])
    return time.perf_counter() - t0


MODES = {
    "load": _load,
    "prefetch + load": _prefetch_load,
    "read ahead + load": _ahead_load,
    "restore (concatenate)": _restore_concatenate,
    "restore (streamed)": _restore_streamed,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, help="where to write (default: a temp dir on /var/tmp)")
    ap.add_argument("--entries", type=int, default=32)
    ap.add_argument("--big", type=int, default=4, help="entries of ~16 MiB (1024 tokens x 4 heads)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, of: {', '.join(MODES)} (default: all)",
    )
    ap.add_argument(
        "--rest",
        type=int,
        default=512,
        help="tokens of the prompt after the restored prefix: after a restore mode, its "
        "first chunk's cache update is timed apart (default 512; 0: not timed)",
    )
    ap.add_argument(
        "--mlx-cache",
        type=int,
        default=None,
        help="MLX's buffer cache limit in bytes (mx.set_cache_limit; default: MLX's own): a "
        "large one lets a restore reuse the memory an earlier one freed, without page faults",
    )
    args = ap.parse_args()
    if args.mlx_cache is not None:
        print(f"MLX buffer cache limit {args.mlx_cache} (was {mx.set_cache_limit(args.mlx_cache)})")

    base = args.dir or Path(tempfile.mkdtemp(prefix="tierchat-ssd-speed-", dir="/var/tmp"))
    cache = base / "kv"
    try:
        tier = SSDTier(cache, FP, 1 << 40)
        ids = []
        shape = (args.layers, args.heads, args.tokens, args.head_dim)
        for i in range(args.entries):
            e = make_entry(i, *shape)
            tier.put(e)
            ids.append(e.id)
        for i in range(args.big):
            e = make_entry(10_000 + i, args.layers, 4, 1024, args.head_dim)
            tier.put(e)
            ids.append(e.id)
        tier.close()
        paths = [tier._path(i) for i in ids]
        total = sum(p.stat().st_size for p in paths)
        print(
            f"{len(paths)} files, {total / 2**20:.1f} MiB "
            f"({args.entries} x {shape} bf16 K/V + {args.big} big) in {cache}"
        )
        leaves = [KVLeaf(str(layer), "kv", "KVCache") for layer in range(args.layers)]
        modes = {name: MODES[name] for name in args.modes.split(",")}
        if args.big:  # the big entries have another shape: no cache of one restore
            modes = {k: v for k, v in modes.items() if not k.startswith("restore")}
        ratios: dict[str, list[float]] = {name: [] for name in modes}
        gbps: dict[str, list[float]] = {name: [] for name in ("raw read", *modes)}
        chunk: dict[str, list[float]] = {name: [] for name in modes}
        cpu: dict[str, list[float]] = {name: [] for name in ("raw read", *modes)}
        for r in range(args.rounds):
            line = []
            for name, run in modes.items():
                # the raw read right before each mode: the disk's speed moves over a run
                c0 = _cpu_s()
                disk = measure_read_bandwidth(paths, drop_cache=True)
                cpu["raw read"].append((_cpu_s() - c0) / (total / 1e9))
                drop_page_cache(paths)
                fresh = _Tier(cache, FP, 1 << 40)
                try:
                    c0, t0 = _cpu_s(), time.perf_counter()
                    caches = run(fresh, ids, leaves, args.tokens, args.rest)
                    dt, dc = time.perf_counter() - t0, _cpu_s() - c0
                    if caches and args.rest:
                        chunk[name].append(_first_chunk_s(caches, args.rest))
                    del caches
                finally:
                    fresh.close()
                ratios[name].append(total / dt / 1e9 / disk.gbps)
                gbps[name].append(total / dt / 1e9)
                gbps["raw read"].append(disk.gbps)
                cpu[name].append(dc / (total / 1e9))
                line.append(
                    f"{name} {total / dt / 1e9:.2f} GB/s / raw {disk.gbps:.2f} = "
                    f"{ratios[name][-1]:.2f} (CPU {cpu[name][-1]:.2f} s/GB"
                    + (f", first chunk {chunk[name][-1]:.2f} s)" if chunk[name] else ")")
                )
            print(f"round {r + 1}: " + "; ".join(line), flush=True)
        for name, rs in ratios.items():
            print(
                f"{name}: median {_median(gbps[name]):.2f} GB/s, median ratio "
                f"{_median(rs):.2f} of the disk's raw read, CPU {_median(cpu[name]):.2f} s/GB"
                + (
                    f", then {_median(chunk[name]):.2f} s to write a {args.rest}-token chunk"
                    if chunk[name]
                    else ""
                )
            )
        print(
            f"raw read: median {_median(gbps['raw read']):.2f} GB/s, "
            f"CPU {_median(cpu['raw read']):.2f} s/GB"
        )
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
