"""``tierchat cache stats [--json]`` and ``tierchat cache clear hot|ssd|tails|all``.

When a tierchat TUI runs on the same cache directory, both talk to it (its status file
and request folder, ``tierchat.core.live_status``): ``stats`` shows the running app's
figures -- its hot tier, tails and counters live only in its process -- and says so;
``clear`` asks the app to clear the tier through its own engine, so its panels stay
right, and prints what it removed, in the words every process's clear uses
(:func:`~tierchat.core.live_status.clear_report`: the app's own keys, a running
``serve``, ``chat`` or ``replay``, or this process).

Otherwise both load the model (``--model``, or the config file's or environment's):
block ids and the SSD directory are salted with the model's fingerprint, so the cache of
one model is only reachable through that model. With no model named anywhere, they load
the one model whose cache the dir holds (each SSD folder records its model,
:mod:`tierchat.core.cache.ssd.model_file`); a dir that holds none, or several, is an
error asking for ``--model``, and nothing is created. ``stats`` of a fresh process shows the SSD tier (its index
is rebuilt from file headers at start); the hot tier and tails live in one process only.

Sizes print in binary units (KiB, MiB, GiB: ``tierchat.core.units.fmt_bytes``, the one
byte formatter), durations as ``fmt_seconds``, rates to one decimal, hit rates as
percentages; ``--json`` keeps raw numbers and field names. Hits are counted as the panels
count them, and the table names them as the panels do: ``hot.entries_used`` (the JSON's
``hot.hits``) the hot entries a restore used, per entry (the Hot panel's "entries used"),
``ssd.entries_read`` (``ssd.hits``) the SSD files read, ``resident.hits`` the turns served
by the resident cache, and ``lookups.hits`` every turn that hit, of every kind (resident,
hot, SSD), with ``lookups.hit_rate`` over ``lookups.lookups`` (the Hits panel's "hit
rate"). Both forms carry these three totals.
"""

from __future__ import annotations

import json
import time
from dataclasses import fields, is_dataclass
from typing import Any

from tierchat.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CLIError, start_engine, table
from tierchat.core.api import LookupStats, plain
from tierchat.core.cache.ssd.model_file import models_in
from tierchat.core.live_status import (
    clear_tier,
    owner_message,
    read_status,
    request_clear,
    wait_cleared,
)
from tierchat.core.units import fmt_bytes, fmt_seconds

BYTE_FIELDS = ("nbytes", "max_bytes", "peak_memory_bytes", "restore_bytes", "ssd_write_bytes")
MEMORY_BYTE_FIELDS = ("active", "peak", "cache", "limit", "device_total", "system_total")
MEMORY_BYTE_FIELDS += ("system_available",)
CLEAR_TIMEOUT_S = 10.0


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted.name, value)`` for every leaf of a (nested) dataclass snapshot or of its
    plain-JSON form (dicts)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in fields(obj)]
    else:
        items = list(obj.items())
    rows: list[tuple[str, Any]] = []
    for key, value in items:
        name = f"{prefix}{key}"
        if key == "events":
            rows.append((name, len(value)))
        elif (is_dataclass(value) and not isinstance(value, type)) or (
            isinstance(value, dict) and key not in ("cached_by", "cached_kind")
        ):
            rows.extend(flatten(value, name + "."))
        elif isinstance(value, dict):
            rows.extend((f"{name}.{k}", v) for k, v in value.items())
        elif isinstance(value, (tuple, list)) and value and is_dataclass(value[0]):
            for i, item in enumerate(value):  # ranks: one block of rows per rank
                rows.extend(flatten(item, f"{name}.{i}."))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for i, item in enumerate(value):  # the same, in plain-JSON form
                rows.extend(flatten(item, f"{name}.{i}."))
        elif isinstance(value, (tuple, list)):
            rows.append((name, ", ".join(map(str, value)) or "-"))
        else:
            rows.append((name, value))
    return rows


def is_bytes(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    if name.startswith(("ranks.", "wear.")) and leaf.endswith("_bytes"):
        return True
    return leaf in BYTE_FIELDS or (name.startswith("memory.") and leaf in MEMORY_BYTE_FIELDS)


def lookup_totals(stats: Any) -> dict[str, Any]:
    """The turn-level totals of the Hits panel (``LookupStats``' ``hits``, ``lookups``,
    ``hit_rate``) of a snapshot or of its plain-JSON form; ``{}`` when it has no lookups."""
    raw = stats.get("lookups") if isinstance(stats, dict) else getattr(stats, "lookups", None)
    if raw is None:
        return {}
    if isinstance(raw, dict):
        known = {f.name for f in fields(LookupStats)}
        raw = LookupStats(**{k: int(v) for k, v in raw.items() if k in known})
    return {"hits": raw.hits, "lookups": raw.lookups, "hit_rate": raw.hit_rate}


def fmt_number(name: str, value: float) -> str:
    """A float of the table, rounded as the panels show it: ``*_s`` a duration, ``*_tps``
    a rate, ``hit_rate`` a percentage, anything else two decimals."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("_s"):
        return fmt_seconds(value)
    if leaf.endswith("_tps"):
        return f"{value:.1f} tok/s"
    if leaf.endswith("hit_rate"):
        return f"{value:.0%}"
    return f"{value:.2f}"


# the table's names for counters whose field name reads as something else (module doc)
TABLE_NAMES = {"hot.hits": "hot.entries_used", "ssd.hits": "ssd.entries_read"}


def stats_rows(stats: Any) -> list[tuple[str, Any]]:
    """The table of ``cache stats``: byte fields in binary units, floats rounded
    (:func:`fmt_number`), the lookups' totals after their counts, "" as "-", and the
    counters named as the panels name them (:data:`TABLE_NAMES`)."""
    rows = [(TABLE_NAMES.get(name, name), value) for name, value in flatten(stats)]
    at = max((i + 1 for i, (name, _) in enumerate(rows) if name.startswith("lookups.")), default=0)
    rows[at:at] = [(f"lookups.{k}", v) for k, v in lookup_totals(stats).items()]
    out = []
    for name, value in rows:
        if isinstance(value, int) and not isinstance(value, bool) and is_bytes(name):
            value = fmt_bytes(value)
        elif isinstance(value, float):
            value = fmt_number(name, value)
        out.append((name, "-" if value == "" else value))
    return out


def _events(stats: Any) -> list[str]:
    events = stats["events"] if isinstance(stats, dict) else stats.events
    return [text for _, text in events]


def _print_stats(stats: Any, as_json: bool, source: dict[str, Any]) -> None:
    if as_json:
        data = plain(stats)
        if "lookups" in data:
            data["lookups"].update(lookup_totals(stats))
        data["source"] = source
        print(json.dumps(data, indent=2))
        return
    print(table(stats_rows(stats)))
    for text in _events(stats):
        print(f"event: {text}")


def run_cache(settings: Any, action: str, args: Any) -> int:
    live = read_status(settings.cache_dir)
    if live is not None:
        return _run_live(settings, action, args, live)
    busy = owner_message(settings.cache_dir)
    if busy is not None:  # an owner that writes no status (yet): never act under it
        raise CLIError(busy, EXIT_FAILED)
    model = dir_model(settings)
    engine = start_engine(settings, model)
    try:
        if action == "stats":
            _print_stats(engine.stats(), getattr(args, "json", False), {"process": "this"})
            return EXIT_OK
        print(f"{clear_tier(engine, args.tier)}\n  by this process (model {model})")
        return EXIT_OK
    finally:
        engine.close()


def dir_model(settings: Any) -> str:
    """The model to open ``settings.cache_dir`` with: the one named (flag, config file,
    environment), else the one model whose cache the dir holds. Raises :class:`CLIError`
    (usage) when none is named and the dir holds no model's cache, or several; reads only.
    """
    if settings.sources.get("model", "default") != "default":
        return settings.model
    models = models_in(settings.cache_dir)
    if len(models) == 1:
        return models[0]
    if not models:
        raise CLIError(
            f"{settings.cache_dir} holds no model's cache (or one written before tierchat "
            "recorded its model); name the model with --model",
            EXIT_USAGE,
        )
    raise CLIError(
        f"{settings.cache_dir} holds the caches of {len(models)} models "
        f"({', '.join(models)}); name one with --model",
        EXIT_USAGE,
    )


def _run_live(settings: Any, action: str, args: Any, live: dict[str, Any]) -> int:
    pid, model = live.get("pid"), live.get("model") or "no model"
    age = max(0.0, time.time() - float(live.get("written_at", 0)))
    process = live.get("process") or "TUI"
    where = f"the running tierchat {process} (pid {pid}, model {model})"
    if action == "stats":
        as_json = getattr(args, "json", False)
        if not as_json:
            print(f"live figures from {where}, updated {fmt_seconds(age)} ago")
        source = {"process": process, "pid": pid, "written_at": live.get("written_at")}
        _print_stats(live["stats"], as_json, source)
        return EXIT_OK
    rid = request_clear(settings.cache_dir, args.tier)
    served = wait_cleared(settings.cache_dir, rid, timeout_s=CLEAR_TIMEOUT_S)
    if served is None:
        raise CLIError(
            f"{where} did not answer the clear request in {CLEAR_TIMEOUT_S:.0f} s; "
            "nothing was cleared (stop it, or clear from its own controls)",
            EXIT_FAILED,
        )
    print(f"{served['report']}\n  by {where}")
    return EXIT_FAILED if str(served["report"]).startswith("failed") else EXIT_OK
