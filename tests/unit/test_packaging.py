"""The package list in pyproject.toml names every package of the tree (a wheel built from
it ships the whole app; docs/DESIGN.md §1). Reads files only: runs in well under a second.
The wheel itself is built and installed in tests/system/test_wheel.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tree_packages() -> set[str]:
    """Every folder with an ``__init__.py`` under a mapped top-level dir, as its dotted
    installed name (``tui/services`` -> ``tierchat.tui.services``)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    out = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if any(part.startswith(".") or part == "node_modules" for part in rel.parts):
                continue
            out.add(".".join([name, *rel.parts]))
    return out


def test_every_package_folder_is_listed():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    tree = tree_packages()
    assert tree - listed == set(), (
        f"folders with __init__.py missing from pyproject: {tree - listed}"
    )
    assert listed - tree == set(), f"listed packages with no folder: {listed - tree}"
