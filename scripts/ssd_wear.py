"""Bytes the SSD tier writes on a scripted chat, against the K/V of its distinct tokens.

    python scripts/ssd_wear.py [--model demo] [--script cli/workloads/mt-chat.jsonl]

Runs ``tierchat replay SCRIPT`` once with a fresh cache dir (every setting else as
configured), then reports: the files left on disk and their bytes; the bytes written as the
write ledger counts them (docs/DESIGN.md §8.6; absent on builds without it); the distinct
tokens of the chat (every prompt + reply of every conversation, shared prefixes once) and
their K/V bytes; bytes written per distinct token and as a multiple of that K/V; and, for
every op right after a ``restart``, its cached and prefilled tokens and the tokens the SSD
tier gave. One JSON object on stdout.

Distinct tokens: a conversation's op ``i + 1`` continues op ``i``'s prompt and reply, so
a conversation holds its last prompt and reply, plus every reply a regenerate replaced;
conversations share their first ``shared`` tokens (the chat template's head and the
system prompt: the common prefix of two conversations' first prompts, measured with the
model's tokenizer through tierchat's prompt builder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _kv_bytes_per_token(model: str) -> int:
    """K/V bytes per token of ``model`` as the engine caches it (its compute dtype)."""
    from tierchat.config.settings import load_settings
    from tierchat.core.engine.engine import Engine

    settings = load_settings({"model": model, "no_cache": True})
    engine = Engine(settings)
    try:
        engine.load_model(model).wait(600)
        per_token = engine.call(lambda: _per_token(engine))
    finally:
        engine.close()
    return per_token


def _per_token(engine) -> int:
    import mlx.core as mx

    caches = engine.runtime.make_cache()
    engine.loaded.model(mx.array([[0, 0]]), cache=caches)
    mx.eval([c.state for c in caches])
    # K/V buffers are allocated in steps of tokens: count the 2 tokens held
    kv = [(c.keys, c.values, c.offset) for c in caches if getattr(c, "keys", None) is not None]
    return sum((k.nbytes + v.nbytes) * n // k.shape[2] for k, v, n in kv) // 2


def _shared_prefix(model: str, ops: list[dict]) -> int:
    from mlx_lm.utils import load_tokenizer
    from tierchat.core.chat.prompts import build_prompt
    from tierchat.core.models.loading import default_models_dir, resolve_model_dir

    firsts, system = [], None
    for op in ops:
        if op["op"] == "new":
            system = op.get("system")
        elif op["op"] == "user" and system is not None:
            firsts.append(
                [{"role": "system", "content": system}, {"role": "user", "content": op["text"]}]
            )
            system = None
    if len(firsts) < 2:
        return 0
    d = resolve_model_dir(
        model, Path(os.environ.get("TIERCHAT_MODELS_DIR") or default_models_dir())
    )
    tok = load_tokenizer(d)
    a, b = (build_prompt(tok, m).token_ids for m in firsts[:2])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--script", default="cli/workloads/mt-chat.jsonl")
    p.add_argument("--cache-dir", help="the replay's cache dir (kept); default a temporary one")
    p.add_argument(
        "--replayed",
        help="analyze this earlier replay's output (with --cache-dir its cache) instead of running",
    )
    a = p.parse_args()
    ops = [json.loads(line) for line in Path(a.script).read_text().splitlines() if line.strip()]
    tmp = tempfile.TemporaryDirectory()
    cache_dir = Path(a.cache_dir or Path(tmp.name) / "kv")
    if a.replayed:
        stdout = Path(a.replayed).read_text()
    else:
        cmd = ["tierchat", "--model", a.model, "--cache-dir", str(cache_dir), "replay", a.script]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode not in (0, 1):
            sys.exit(f"replay failed ({done.returncode}): {done.stderr[-2000:]}")
        stdout = done.stdout
    lines = [json.loads(x) for x in stdout.splitlines() if x.strip()]
    results = [x for x in lines if "op_index" in x]
    summary = next((x["summary"] for x in lines if "summary" in x), {})
    files = [f for f in cache_dir.rglob("*.safetensors") if f.is_file()]
    on_disk = sum(f.stat().st_size for f in files)
    ledger = cache_dir / "ssd-writes.json"
    written = json.loads(ledger.read_text())["total_bytes"] if ledger.exists() else None

    # distinct tokens: per conversation its last prompt + reply and every replaced reply
    by_index = {r["op_index"]: r for r in results}
    distinct, convs, last, restarts = 0, 0, None, []
    after_restart = False
    for i, op in enumerate(ops):
        if op["op"] == "new":
            if last is not None:
                distinct += last["prompt_tokens"] + last["generation_tokens"]
            convs, last = convs + 1, None
        elif op["op"] == "restart":
            after_restart = True
        elif i in by_index:
            r = by_index[i]
            if op["op"] == "regenerate" and last is not None:
                distinct += last["generation_tokens"]  # the reply it replaced
            if after_restart:
                restarts.append(
                    {
                        k: r[k]
                        for k in ("op_index", "prompt_tokens", "cached_tokens", "prefill_tokens")
                    }
                    | {"ssd_tokens": r["cached_by"].get("ssd", 0)}
                )
                after_restart = False
            last = r
    if last is not None:
        distinct += last["prompt_tokens"] + last["generation_tokens"]
    shared = _shared_prefix(a.model, ops)
    distinct -= shared * max(0, convs - 1)
    per_token = _kv_bytes_per_token(a.model)
    kv = distinct * per_token
    out = {
        "model": a.model,
        "script": a.script,
        "requests": len(results),
        "conversations": convs,
        "prompt_tokens_sum": sum(r["prompt_tokens"] for r in results),
        "distinct_tokens": distinct,
        "shared_prefix_tokens": shared,
        "kv_bytes_per_token": per_token,
        "distinct_kv_bytes": kv,
        "files_on_disk": len(files),
        "bytes_on_disk": on_disk,
        "bytes_written": written,
        "written_per_distinct_token": round((written or on_disk) / max(distinct, 1)),
        "written_over_distinct_kv": round((written or on_disk) / max(kv, 1), 3),
        "after_restart": restarts,
        "wear": summary.get("cache", {}).get("wear"),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
