"""``tierchat bench``: TTFT of the prefix cache's paths, side by side with mlx-lm's
``LRUPromptCache`` in the same run (docs/DESIGN.md §17: ratios measured together, never asserted).

For each prompt length N (tokens; deterministic text) and each of ``--repeat`` prompts
(default 3; every measured prompt has its own first word, so no two share a prefix), with
one generated token per request; each row shows the run with the median TTFT:

tierchat rows (through the :class:`~tierchat.core.engine.engine.Engine`):
  cold           a fresh cache: prefill N
  exact hot      the same prompt again (a regenerate): the resident cache cut back to N
                 and the first token sampled from the logprobs kept from the request
                 before, no forward (where every layer can be cut back in place; else
                 N-1 restored and 1 token prefilled, as on hybrid models)
  nearest hot    prompt + ``--extend`` new tokens: restore the cached prefix, prefill the rest
  exact ssd      after a restart (new Engine: hot tier and tails gone) with the page cache
                 of the SSD files dropped before each request where the OS allows
                 (``posix_fadvise`` DONTNEED after ``fsync``; the output says whether it
                 could), once the start-up verifier has read every file

mlx-lm rows (:class:`~tierchat.cli.bench.mlx_baseline.LRUBaseline`: ``mlx_lm.server``'s
default path for a completion request: ``fetch_nearest_cache``, its ``BatchGenerator``
prefilling the rest in steps of 2048, a cache saved one token before the prompt's end,
and prompt + generated tokens saved at the end; 10 entries, the server's
``--prompt-cache-size``): cold, exact hot, nearest hot. It has no disk tier. On a hybrid
model (``shape:qwen3.5-0.8b``) its rows still run: it reuses only exact or shorter
checkpoints there, which is the point of the comparison.

The two systems take turns, request by request: each prompt's cold, exact hot and nearest
hot request runs on tierchat and on mlx-lm one after the other (who goes first alternates
from prompt to prompt). mlx-lm runs on the engine thread (:meth:`Engine.call
<tierchat.core.engine.engine.Engine.call>`) with the engine's model, so no two threads touch MLX
at once (docs/DESIGN.md §2) and both systems meet the same GPU state: clocks, memory in use,
other load. A GPU's speed drifts by up to 2x over minutes, so rows measured minutes apart
would compare the machine with itself, not the systems.

Before each request of either system the bench waits until the SSD writer has written what
the earlier ones stored, as it has between the turns of a chat (the writer is paused while
a request prefills and makes its first token, and resumes after).

Disk: before the SSD rows, the files the bench's own SSD tier wrote are read once with
large sequential reads after their page cache is dropped (:func:`measure_read_bandwidth`);
the table shows each SSD restore's GB/s as a fraction of that bandwidth. Each tierchat row
also shows its TTFT over mlx-lm's for the same length and case (< 1: tierchat is faster).

Restore time and bytes: for tierchat the engine's ``TurnMetrics.restore_s`` (finding,
loading and splicing cached entries) and ``restore_bytes``; for mlx-lm the time of
``fetch_nearest_cache`` (deep copy + trim) plus an ``mx.eval`` of the copied state, and
that state's bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from tierchat.cli.bench.mlx_baseline import LRUBaseline
from tierchat.cli.common import EXIT_OK, EXIT_USAGE, CLIError, start_engine, table
from tierchat.core.cache.ssd.io import ReadBandwidth, measure_read_bandwidth
from tierchat.core.cache.ssd.io import drop_page_cache as _drop_files
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.units import fmt_bytes

SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the riverbank.",
    "A cache that remembers prefixes turns long prompts into short ones.",
    "Every block of tokens is keyed by the hash of its parent and its contents.",
    "Rain fell softly on the tin roof while the kettle began to sing.",
    "Seven engineers argued about eviction policies until the coffee ran out.",
    "In the morning the harbour was full of small boats with red sails.",
    "Time to first token is the number that users feel on every turn.",
    "She wrote the numbers down, checked them twice, and then checked them again.",
    "Sliding windows forget the distant past but keep the recent tokens close.",
    "The recurrent state is small, fixed in size, and cannot be sliced.",
    "Old maps show rivers that have since moved a mile to the east.",
    "A good benchmark prints ratios measured side by side in one run.",
)


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lengths = []
    if not lengths or any(n < 2 for n in lengths):
        raise CLIError(
            f"--lengths {text!r}: expected integers >= 2 separated by commas", EXIT_USAGE
        )
    return lengths


CODEWORDS = (
    "Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel", "India",
    "Juliett", "Kilo", "Lima", "Mike", "November", "Oscar", "Papa", "Quebec", "Romeo",
    "Sierra", "Tango", "Uniform", "Victor", "Whiskey", "Xray", "Yankee", "Zulu",
)  # fmt: skip
WARMUP_SALT = len(CODEWORDS) - 1  # the warm-up prompt's first word: Zulu


def make_prompt(tokenizer: Any, n_tokens: int, salt: int = 0) -> list[int]:
    """Exactly ``n_tokens`` token ids of deterministic English text. The first word is
    ``CODEWORDS[salt]``: prompts with different salts differ in their first token, so they
    share no prefix (not even a few tokens that mlx-lm's trie would reuse). The text grows
    by doubling, so a 32K-token prompt costs a handful of encodes, not hundreds."""
    header = f"{CODEWORDS[salt % len(CODEWORDS)]}: a benchmark prompt of {n_tokens} tokens. "
    parts, i, groups = [header], 0, 1
    while True:
        for _ in range(groups):
            parts.extend(SENTENCES[(i * 7 + j) % len(SENTENCES)] + " " for j in range(8))
            i += 1
        ids = list(tokenizer.encode("".join(parts), add_special_tokens=False))
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
        groups *= 2


def extension(tokenizer: Any, n_tokens: int) -> list[int]:
    """``n_tokens`` ids of a follow-up question (for the nearest-prefix rows)."""
    text = " Now answer one question about the text above, briefly and precisely. " * 8
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    while len(ids) < n_tokens:
        ids += ids
    return ids[:n_tokens]


def drop_page_cache(directory: Path) -> tuple[bool, str]:
    """Drop the page cache of every file under ``directory`` (:func:`~tierchat.core.cache.
    ssd.drop_page_cache`). Returns ``(dropped, note)``: ``dropped`` only if it was done for
    every file (never on macOS, which has no ``posix_fadvise``)."""
    if not hasattr(os, "posix_fadvise"):
        return False, "page cache not dropped: posix_fadvise is not available on this OS"
    files = [p for p in directory.rglob("*") if p.is_file()]
    if not files:
        return False, f"page cache not dropped: no files under {directory}"
    done = _drop_files(files)
    if done < len(files):
        return False, f"page cache dropped for {done} of {len(files)} files"
    return True, f"page cache dropped for {len(files)} files (fsync + posix_fadvise DONTNEED)"


def measured_prompts(tokenizer: Any, lengths: list[int], repeat: int) -> dict[int, list]:
    """``repeat`` prompts per length, each with its own first word (salts 0, 1, ... below
    the warm-up's), so no two measured prompts share a prefix."""
    salts = iter(range(len(lengths) * repeat))
    return {n: [make_prompt(tokenizer, n, next(salts)) for _ in range(repeat)] for n in lengths}


def max_repeat(n_lengths: int) -> int:
    """The most prompts per length that keep every first word distinct: the warm-up
    prompts take the last ``n_lengths + 1`` of :data:`CODEWORDS`."""
    return max(0, (len(CODEWORDS) - n_lengths - 1) // n_lengths)


def _median_row(system: str, case: str, length: int, runs: list[tuple[dict, tuple]]) -> dict:
    """One table row from ``runs`` (``(counts, (restore_s, restore_bytes))`` per prompt):
    the run with the median TTFT (the lower middle one for an even count), whose counts
    and restore figures it shows, plus every run's TTFT (``ttft_runs_s``) and cached
    tokens (``cached_runs``)."""
    ordered = sorted(runs, key=lambda r: r[0]["ttft_s"])
    row = _row(system, case, length, *ordered[(len(ordered) - 1) // 2])
    row["ttft_runs_s"] = [m["ttft_s"] for m, _ in runs]
    row["cached_runs"] = [m["cached_tokens"] for m, _ in runs]
    return row


HOT_CASES = ("cold", "exact hot", "nearest hot")


def _hot_rows(length: int, prompts: list, ext: list[int], runners: dict) -> list[dict]:
    """The cold, exact hot and nearest hot rows of one length for every system in
    ``runners`` (system name -> a function from a prompt to the ``(counts, restore)`` of
    one request): for each prompt, the prompt, the prompt again, then the prompt extended
    by ``ext``, each run on every system in turn; the first system alternates from prompt
    to prompt, so neither always runs right after the other's request."""
    runs: dict[str, dict[str, list]] = {s: {c: [] for c in HOT_CASES} for s in runners}
    order = list(runners.items())
    for p in prompts:
        for case, q in zip(HOT_CASES, (p, p, p + ext), strict=True):
            for system, run in order:
                runs[system][case].append(run(q))
        order.reverse()
    return [
        _median_row(system, case, length, got)
        for system, cases in runs.items()
        for case, got in cases.items()
    ]


def _row(system: str, case: str, length: int, m: Any, restore: tuple[float, int]) -> dict:
    seconds, nbytes = restore
    return {
        "system": system,
        "case": case,
        "length": length,
        "prompt_tokens": m["prompt_tokens"],
        "cached_tokens": m["cached_tokens"],
        "prefill_tokens": m["prefill_tokens"],
        "ttft_s": m["ttft_s"],
        "restore_s": seconds if m["cached_tokens"] else None,
        "restore_bytes": nbytes if m["cached_tokens"] else None,
        "restore_gbps": (nbytes / seconds / 1e9) if m["cached_tokens"] and seconds > 0 else None,
    }


def writer_idle(engine: Any) -> None:
    """Wait until ``engine``'s SSD writer has written what earlier requests stored, as it
    has between the turns of a chat (no-op without an SSD tier)."""
    if engine.cache is not None and engine.cache.ssd is not None:
        engine.cache.ssd.flush()


class EngineBench(NamedTuple):
    """What :func:`bench_engine` measured: the rows, the page-cache note of the SSD rows,
    the disk's read bandwidth over the SSD files (None without an SSD tier or files) and
    the loaded model's compute dtype."""

    rows: list[dict]
    page_cache: str
    disk: ReadBandwidth | None
    dtype: str


def bench_engine(
    settings: Any, lengths: list[int], extend: int, repeat: int, log, baseline: bool = True
) -> EngineBench:
    """tierchat rows for every length (medians over ``repeat`` prompts), taking turns with
    mlx-lm's rows when ``baseline``; then the disk read bandwidth of the SSD files written
    and the exact SSD rows from a restarted engine."""
    from tierchat.core.api import Failed, GenerateRequest

    quiet = writer_idle

    def run(engine: Any, prompt: list[int], use_cache: bool = True) -> tuple[dict, tuple]:
        quiet(engine)
        result = engine.submit(
            GenerateRequest(
                sampling=SamplingParams(max_tokens=1), prompt_ids=tuple(prompt), use_cache=use_cache
            )
        ).wait()
        if isinstance(result, Failed):
            raise CLIError(f"bench generation failed: {result.message}")
        m = result.metrics
        counts = {
            "prompt_tokens": m.prompt_tokens,
            "cached_tokens": m.cached_tokens,
            "prefill_tokens": m.prefill_tokens,
            "ttft_s": m.ttft_s,
        }
        return counts, (m.restore_s, m.restore_bytes)

    rows: list[dict] = []
    # every prompt's entries reach the SSD tier (write-through, not admission by reuse,
    # docs/DESIGN.md §8.6), so the exact SSD rows measure each prompt's restore from disk
    engine = start_engine(dataclasses.replace(settings, ssd_admission=False))
    try:
        tok = engine.tokenizer
        prompts = measured_prompts(tok, lengths, repeat)
        ext = extension(tok, extend)
        runners = {"tierchat": lambda p: run(engine, p)}
        lru = LRUBaseline(engine, settings.model) if baseline else None
        if lru is not None:

            def run_lru(prompt: list[int]) -> tuple[dict, tuple]:
                quiet(engine)
                return lru.run(prompt)

            runners["mlx-lm LRU"] = run_lru
        run(engine, make_prompt(tok, 64, salt=WARMUP_SALT), use_cache=False)  # warm-up
        # warm-up at every length (GPU kernels are compiled per shape on first use), on
        # prompts sharing nothing with the measured ones; then every cache is emptied
        log("warm-up at every length")
        for i, n in enumerate(lengths):
            warm = make_prompt(tok, n, salt=WARMUP_SALT - 1 - i)
            for p in (warm, warm, warm + ext):
                for measure in runners.values():
                    measure(p)
            quiet(engine)
            engine.clear("hot")  # and a restore from the SSD tier at this length too
            run(engine, warm)
        engine.clear("all")
        if lru is not None:
            lru.clear()
        for n in lengths:
            systems = " and ".join(runners)
            log(f"{n} tokens: cold, exact hot, nearest hot ({repeat} prompts; {systems})")
            rows += _hot_rows(n, prompts[n], ext, runners)
        if lru is not None:
            lru.clear()  # its caches hold no memory while the restarted engine measures
        ssd_dir = (
            engine.cache.ssd.dir
            if engine.cache is not None and engine.cache.ssd is not None
            else None
        )
        dtype = engine.loaded.dtype
    finally:
        engine.close()
    note, disk = "page cache: no SSD tier", None
    if ssd_dir is not None:
        files = sorted(p for p in Path(ssd_dir).rglob("*") if p.is_file())
        if files:
            log(f"disk: sequential read of the {len(files)} SSD files written")
            disk = measure_read_bandwidth(files)
        note = drop_page_cache(Path(ssd_dir))[1]  # again: the measurement read them in
    # these rows measure the disk path: always read the SSD tier (a fast GPU may otherwise
    # choose to compute the tokens again, docs/DESIGN.md §8.4)
    engine = start_engine(dataclasses.replace(settings, choose_recompute=False), quiet=True)
    try:
        run(engine, make_prompt(engine.tokenizer, 64, salt=WARMUP_SALT), use_cache=False)
        if engine.cache is not None and engine.cache.ssd is not None:
            # the start-up verifier reads every file once: let it finish, so it neither
            # competes for the disk nor leaves some files in the page cache
            engine.cache.ssd.wait_verified()

        def restart_run(prompt: list[int]) -> tuple[dict, tuple]:
            quiet(engine)  # what the writer has to write is written, then dropped too
            if ssd_dir is not None:
                drop_page_cache(Path(ssd_dir))
            return run(engine, prompt)

        for n in lengths:  # the prompts share no prefix: each restore reads its own files
            log(f"tierchat {n} tokens: exact ssd ({repeat} prompts)")
            got = [restart_run(p) for p in prompts[n]]
            rows.append(_median_row("tierchat", "exact ssd", n, got))
    finally:
        engine.close()
    return EngineBench(rows, note, disk, dtype)


def add_speedups(rows: list[dict]) -> None:
    """``speedup`` = TTFT of the same system's cold row at that length / this TTFT."""
    cold = {(r["system"], r["length"]): r["ttft_s"] for r in rows if r["case"] == "cold"}
    for r in rows:
        base = cold.get((r["system"], r["length"]))
        r["speedup"] = base / r["ttft_s"] if base and r["ttft_s"] > 0 else None


def add_ratios(rows: list[dict], disk: ReadBandwidth | None) -> None:
    """``vs_mlx_lm`` = this tierchat TTFT / mlx-lm's TTFT for the same length and case
    (< 1: tierchat is faster; None on mlx-lm rows and where mlx-lm has no such case);
    ``of_disk`` = an SSD row's restore GB/s / the disk's sequential read GB/s."""
    lru = {(r["length"], r["case"]): r["ttft_s"] for r in rows if r["system"] != "tierchat"}
    for r in rows:
        base = lru.get((r["length"], r["case"])) if r["system"] == "tierchat" else None
        r["vs_mlx_lm"] = r["ttft_s"] / base if base else None
        ssd = r["case"] == "exact ssd" and disk is not None and disk.gbps > 0
        r["of_disk"] = r["restore_gbps"] / disk.gbps if ssd and r["restore_gbps"] else None


def format_rows(rows: list[dict]) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    out = [
        (
            r["system"],
            r["case"],
            r["prompt_tokens"],
            r["cached_tokens"],
            r["prefill_tokens"],
            f(r["ttft_s"], ".4f"),
            f(r["speedup"], ".1f") + ("x" if r["speedup"] is not None else ""),
            f(r.get("vs_mlx_lm"), ".2f") + ("x" if r.get("vs_mlx_lm") is not None else ""),
            f(r["restore_s"], ".4f"),
            f(r["restore_gbps"], ".2f"),
            f(None if r.get("of_disk") is None else 100 * r["of_disk"], ".0f")
            + ("%" if r.get("of_disk") is not None else ""),
        )
        for r in rows
    ]
    headers = (
        "system",
        "case",
        "prompt",
        "cached",
        "prefilled",
        "TTFT s",
        "speedup",
        "vs mlx-lm",
        "restore s",
        "restore GB/s",
        "of disk",
    )
    return table(out, headers)


def disk_line(disk: ReadBandwidth | None) -> str:
    """The header line naming the disk's measured sequential read bandwidth."""
    if disk is None:
        return "disk read: not measured (no SSD files)"
    cache = "page cache dropped" if disk.dropped else "page cache NOT dropped: may be RAM speed"
    return (
        f"disk sequential read: {disk.gbps:.2f} GB/s ({fmt_bytes(disk.nbytes)} in "
        f"{disk.files} SSD files, {disk.seconds:.3f} s; {cache})"
    )


@contextlib.contextmanager
def _fresh_cache_dir(cache_dir: Path, log):
    """A new empty directory inside ``cache_dir`` (same disk as the real SSD tier), removed
    afterwards; the system temp dir if ``cache_dir`` is not writable."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.TemporaryDirectory(prefix="bench-", dir=cache_dir)
    except OSError as e:
        log(f"{cache_dir} is not writable ({e.strerror or e}); using the system temp dir")
        tmp = tempfile.TemporaryDirectory(prefix="tierchat-bench-")
    with tmp as path:
        yield Path(path)


def run_bench(settings: Any, args: Any) -> int:
    """``tierchat bench``. The SSD tier goes to a new empty directory inside the cache dir
    (a cold row must be cold; the user's cache is not touched), removed at the end. Prints
    the table, writes ``--json-out``."""
    lengths = parse_lengths(args.lengths)
    if args.extend < 1:
        raise CLIError("--extend must be >= 1", EXIT_USAGE)
    repeat = getattr(args, "repeat", 3)
    if not 1 <= repeat <= max_repeat(len(lengths)):
        raise CLIError(
            f"--repeat {repeat}: expected 1 to {max_repeat(len(lengths))} for "
            f"{len(lengths)} lengths (every measured prompt needs its own first word)",
            EXIT_USAGE,
        )
    if settings.no_cache:
        raise CLIError("bench measures the cache: drop --no-cache", EXIT_USAGE)

    def log(text: str) -> None:
        print(f"bench: {text}", file=sys.stderr, flush=True)

    with _fresh_cache_dir(Path(settings.cache_dir), log) as tmp:
        settings.cache_dir = tmp
        log(f"model {settings.model}, block size {settings.block_size}, SSD dir {tmp}")
        t0 = time.perf_counter()
        measured = bench_engine(
            settings, lengths, args.extend, repeat, log, baseline=not args.no_baseline
        )
        rows, note, disk = measured.rows, measured.page_cache, measured.disk
        wall = time.perf_counter() - t0
    add_speedups(rows)
    add_ratios(rows, disk)
    rows.sort(key=lambda r: (r["length"], r["system"] != "tierchat"))
    from tierchat.core.device import describe_device, device_info

    device = describe_device(measured.dtype)
    print(f"model {settings.model} · block size {settings.block_size} · {device}")
    print(note)
    print(disk_line(disk))
    print(format_rows(rows))
    print(
        f"({wall:.1f} s; speedup = cold TTFT of the same system / this TTFT; vs mlx-lm = "
        "tierchat TTFT / mlx-lm TTFT, same length and case; of disk = SSD restore GB/s / "
        "disk sequential read GB/s)"
    )
    if args.json_out:
        doc = {
            "model": settings.model,
            "block_size": settings.block_size,
            "device": device,
            "device_info": device_info(measured.dtype)._asdict(),
            "page_cache": note,
            "disk_read": None if disk is None else disk._asdict(),
            "lengths": lengths,
            "extend_tokens": args.extend,
            "repeat": repeat,
            "rows": rows,
        }
        try:
            Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            raise CLIError(f"cannot write {args.json_out}: {e.strerror or e}") from None
    return EXIT_OK
