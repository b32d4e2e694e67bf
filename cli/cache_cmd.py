"""``tierchat cache stats [--json]`` and ``tierchat cache clear hot|ssd|tails|all``.

Both load the model (``--model``, default from the settings): block ids and the SSD
directory are salted with the model's fingerprint, so the cache of one model is only
reachable through that model. ``stats`` of a fresh process shows the SSD tier (its index
is rebuilt from file headers at start); the hot tier and tails live in one process only.
"""

from __future__ import annotations

import json
from dataclasses import fields, is_dataclass
from typing import Any

from .common import EXIT_OK, plain, start_engine, table


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted.name, value)`` for every leaf field of a (nested) dataclass snapshot."""
    rows: list[tuple[str, Any]] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if is_dataclass(value):
            rows.extend(flatten(value, name + "."))
        elif isinstance(value, dict):
            rows.extend((f"{name}.{k}", v) for k, v in value.items())
        elif f.name == "events":
            rows.append((name, len(value)))
        elif isinstance(value, tuple):
            rows.append((name, ", ".join(map(str, value)) or "-"))
        else:
            rows.append((name, value))
    return rows


def run_cache(settings: Any, action: str, args: Any) -> int:
    engine = start_engine(settings)
    try:
        if action == "stats":
            stats = engine.stats()
            if getattr(args, "json", False):
                print(json.dumps(plain(stats), indent=2))
            else:
                print(table([(k, "-" if v == "" else v) for k, v in flatten(stats)]))
                for _, text in stats.events:
                    print(f"event: {text}")
            return EXIT_OK
        before = engine.stats()
        engine.clear(args.tier)
        after = engine.stats()
        rows = [
            (tier, getattr(before, tier).entries, getattr(after, tier).entries)
            for tier in ("hot", "ssd", "tails")
        ]
        print(f"cleared {args.tier} for {settings.model}")
        print(table(rows, ("tier", "entries before", "entries after")))
        return EXIT_OK
    finally:
        engine.close()
