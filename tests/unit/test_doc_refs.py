"""Every Sphinx cross-reference to a ``tierchat.`` path in a docstring names something that
exists (a module, or an attribute of one): references go stale when modules move."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REF = re.compile(r":(?:mod|class|func|meth|attr|data|exc):`~?(tierchat\.[\w.]+)`")


def resolves(ref: str) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_tierchat_reference_in_a_docstring_resolves():
    stale = []
    for folder in ("core", "cli", "tui", "config"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for m in REF.finditer(text):
                if not resolves(m.group(1)):
                    line = text.count("\n", 0, m.start()) + 1
                    stale.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert not stale, "\n".join(stale)
