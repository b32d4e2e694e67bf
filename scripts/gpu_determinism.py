"""Which kernels make two processes differ on MLX CUDA, and whether a setting makes them agree.

Two processes that run the same greedy script on the same GPU in bf16 need not produce the
same tokens (docs/DESIGN.md §18). This script finds where they part and what a setting
costs. Run on the device (the GPU machine)::

    python scripts/gpu_determinism.py run --model shape:qwen3-8b --out report.json

``run`` starts ``probe`` twice per environment setting (``--configs``), each in a new
process, and compares the two. A probe loads the model, hashes its weights, and on one fixed
prompt of ``--prompt`` tokens:

1. times a cold prefill and ``--tokens`` greedy decode steps (mlx-lm's ``generate_step``),
   twice in the process (the second is the timed one; the two must agree: the within-process
   check);
2. runs the prefill once more with every ``nn.Linear``, RMSNorm and attention call evaluated
   and hashed as it happens, in call order, keeping the first ``--keep`` outputs whole.

``compare`` of two probes names the first recorded op whose bits differ (and its largest
absolute difference when kept), the number of greedy tokens equal, and the first differing
step. The report holds one row per setting: weights equal, first differing op, tokens equal
of ``--tokens``, both processes' prefill ms and decode tok/s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS: dict[str, dict[str, str]] = {
    "default": {},
    "launch_blocking": {"CUDA_LAUNCH_BLOCKING": "1"},
    "no_graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
    "no_cudnn_sdpa": {"MLX_CUDA_USE_CUDNN_SDPA": "0"},
    "cublas_ws": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
    "hashseed": {"PYTHONHASHSEED": "0"},
    "sync_decode": {"DET_SYNC_DECODE": "1"},
    "lb_graphs": {"CUDA_LAUNCH_BLOCKING": "1", "MLX_USE_CUDA_GRAPHS": "0"},
    "lb_sdpa": {"CUDA_LAUNCH_BLOCKING": "1", "MLX_CUDA_USE_CUDNN_SDPA": "0"},
    "all": {
        "CUDA_LAUNCH_BLOCKING": "1",
        "MLX_USE_CUDA_GRAPHS": "0",
        "MLX_CUDA_USE_CUDNN_SDPA": "0",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONHASHSEED": "0",
    },
}

TEXT = (
    "The harbour master kept a ledger of every ship that entered the bay, noting the tide, "
    "the wind and the cargo. In winter the entries grew short; in summer they ran to pages. "
)


def _prompt_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        ids += tokenizer.encode(f"{i}. {TEXT}")
        i += 1
    return ids[:n]


def _bits(a) -> bytes:
    import mlx.core as mx
    import numpy as np

    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a).tobytes()


def teacher_forced(model, tokenizer, ids: list[int], n_reply: int) -> dict:
    """Logprobs of a fixed reply after ``ids``: cold (one forward of prompt + reply) and
    cached (the prompt prefilled into a cache first, then the reply on it), per reply
    position the top-1 id and the forced token's logprob."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    reply = _prompt_ids(tokenizer, len(ids) + n_reply)[len(ids) :]
    seq = mx.array(ids + reply)[None]
    n = len(ids)

    def read(logits):
        lp = logits.astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        forced = mx.take_along_axis(lp[0, :-1], mx.array(reply[1:])[:, None], axis=-1)
        top = mx.argmax(lp[0, :-1], axis=-1)
        mx.eval(forced, top)
        return {"top1": top.tolist(), "lp": forced[:, 0].tolist()}

    cold = model(seq, cache=make_prompt_cache(model))[:, n:]
    cache = make_prompt_cache(model)
    mx.eval(model(seq[:, :n], cache=cache))
    cached = model(seq[:, n:], cache=cache)
    return {"cold": read(cold), "cached": read(cached)}


def _forced_delta(x: dict, y: dict) -> dict:
    agree = sum(a == b for a, b in zip(x["top1"], y["top1"], strict=False))
    first = next(
        (i for i, (a, b) in enumerate(zip(x["top1"], y["top1"], strict=False)) if a != b), None
    )
    d = max((abs(a - b) for a, b in zip(x["lp"], y["lp"], strict=False)), default=0.0)
    return {"top1_agree": agree, "positions": len(x["top1"]), "first_diff": first, "max_dlp": d}


def probe(args: argparse.Namespace) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    import tierchat.core  # noqa: F401  (OpenBLAS before mlx on the CPU)
    from mlx_lm.generate import generate_step
    from mlx_lm.models import base
    from tierchat.core.models.loading import load_model

    lm = load_model(args.model)
    model = lm.model
    from mlx.utils import tree_flatten

    wh = hashlib.sha256()
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])[:12]:
        wh.update(name.encode() + _bits(p))
    ids = _prompt_ids(lm.tokenizer, args.prompt)
    prompt = mx.array(ids)

    def steps():
        if os.environ.get("DET_SYNC_DECODE") != "1":
            yield from generate_step(prompt, model, max_tokens=args.tokens)
            return
        # no overlap: each step evaluated before the next one is built
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        logits = model(prompt[None], cache=cache)[:, -1]
        for _ in range(args.tokens):
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            y = mx.argmax(lp, axis=-1)
            mx.eval(y, lp)
            yield int(y.item()), lp[0]
            logits = model(y[None], cache=cache)[:, -1]

    def greedy():
        out, lps = [], []
        t0 = time.perf_counter()
        first = None
        for tok, logprobs in steps():
            if first is None:
                first = time.perf_counter() - t0
            out.append(int(tok))
            lps.append(float(logprobs[int(tok)]))
        total = time.perf_counter() - t0
        return out, lps, first, total

    a = greedy()
    b = greedy()
    forced = teacher_forced(model, lm.tokenizer, ids, args.reply)
    rec: list[tuple[str, bytes]] = []
    kept: dict[str, np.ndarray] = {}

    def record(name, out):
        mx.eval(out)
        i = len(rec)
        rec.append((name, hashlib.sha256(_bits(out)).hexdigest()[:16]))
        if i < args.keep:
            kept[f"{i:04d}"] = np.array(out.astype(mx.float32))
        return out

    lin_call, norm_call = nn.Linear.__call__, nn.RMSNorm.__call__
    sdpa = base.scaled_dot_product_attention
    mod = sys.modules[type(model).__module__]

    def lin(self, x):
        return record("linear", lin_call(self, x))

    def norm(self, x):
        return record("rms_norm", norm_call(self, x))

    def attn(*a, **k):
        return record("sdpa", sdpa(*a, **k))

    nn.Linear.__call__, nn.RMSNorm.__call__ = lin, norm
    for m in (base, mod):
        if hasattr(m, "scaled_dot_product_attention"):
            m.scaled_dot_product_attention = attn
    try:
        from mlx_lm.models.cache import make_prompt_cache

        logits = model(prompt[None], cache=make_prompt_cache(model))
        record("logits", logits)
    finally:
        nn.Linear.__call__, nn.RMSNorm.__call__ = lin_call, norm_call
        for m in (base, mod):
            if hasattr(m, "scaled_dot_product_attention"):
                m.scaled_dot_product_attention = sdpa
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **kept)
    meta = {
        "weights": wh.hexdigest()[:16],
        "tokens": b[0],
        "logprobs": b[1],
        "within_process_equal": a[0] == b[0] and a[1] == b[1],
        "forced": forced,
        "prefill_ms": b[2] * 1e3,
        "decode_tps": (len(b[0]) - 1) / max(b[3] - b[2], 1e-9),
        "ops": rec,
        "device": str(mx.default_device()),
        "env": {k: os.environ.get(k) for c in CONFIGS.values() for k in c},
    }
    Path(args.out + ".json").write_text(json.dumps(meta))


def compare(a_path: str, b_path: str) -> dict:
    import numpy as np

    a = json.loads(Path(a_path + ".json").read_text())
    b = json.loads(Path(b_path + ".json").read_text())
    first = next(
        (i for i, (x, y) in enumerate(zip(a["ops"], b["ops"], strict=False)) if x != y), None
    )
    diff = None
    if first is not None:
        ka, kb = np.load(a_path), np.load(b_path)
        key = f"{first:04d}"
        if key in ka.files and key in kb.files:
            diff = float(np.abs(ka[key] - kb[key]).max())
    ta, tb = a["tokens"], b["tokens"]
    same = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
    lp = [
        abs(x - y)
        for x, y, s, t in zip(a["logprobs"], b["logprobs"], ta, tb, strict=False)
        if s == t
    ]
    return {
        "weights_equal": a["weights"] == b["weights"],
        "ops": len(a["ops"]),
        "first_diff_op": None if first is None else [first, a["ops"][first][0]],
        "first_diff_max_abs": diff,
        "tokens_equal": sum(x == y for x, y in zip(ta, tb, strict=False)),
        "tokens": len(ta),
        "first_diff_step": same,
        "max_dlogprob_before_split": max(lp[: same if same is not None else len(lp)], default=0.0),
        "within_process_equal": [a["within_process_equal"], b["within_process_equal"]],
        "forced_cold_vs_cold": _forced_delta(a["forced"]["cold"], b["forced"]["cold"]),
        "forced_cached_vs_cold": [
            _forced_delta(m["forced"]["cached"], m["forced"]["cold"]) for m in (a, b)
        ],
        "prefill_ms": [round(a["prefill_ms"], 1), round(b["prefill_ms"], 1)],
        "decode_tps": [round(a["decode_tps"], 1), round(b["decode_tps"], 1)],
    }


def run(args: argparse.Namespace) -> None:
    report = {"model": args.model, "prompt": args.prompt, "tokens": args.tokens, "rows": {}}
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    for name in args.configs.split(","):
        paths = []
        for k in range(2):
            path = str(tmp / f"{name}-{k}.npz")
            env = {**os.environ, **CONFIGS[name]}
            cmd = [sys.executable, __file__, "probe", "--model", args.model, "--out", path]
            cmd += ["--prompt", str(args.prompt), "--tokens", str(args.tokens)]
            cmd += ["--keep", str(args.keep), "--reply", str(args.reply)]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
                break
            print(f"{name}[{k}] {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            paths.append(path)
        if len(paths) == 2:
            row = compare(*paths)
            report["rows"][name] = row
            print(name, json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("probe", "run"):
        s = sub.add_parser(name)
        s.add_argument("--model", default="shape:qwen3-8b")
        s.add_argument("--out", required=True)
        s.add_argument("--prompt", type=int, default=256, help="prompt tokens")
        s.add_argument("--tokens", type=int, default=40, help="greedy decode steps")
        s.add_argument("--keep", type=int, default=24, help="op outputs kept whole")
        s.add_argument("--reply", type=int, default=64, help="teacher-forced reply tokens")
    sub.choices["run"].add_argument("--configs", default=",".join(CONFIGS))
    sub.choices["run"].add_argument("--tmp", default="/tmp/det")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args()
    if args.cmd == "probe":
        probe(args)
    elif args.cmd == "run":
        run(args)
    else:
        print(json.dumps(compare(args.a, args.b)))


if __name__ == "__main__":
    main()
