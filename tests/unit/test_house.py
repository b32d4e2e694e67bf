"""House rules over the source tree: design pointers resolve, one import style per package.

Reads the repository's files as text (no imports of the modules), so it runs in well
under a second.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
SOURCES = ("core", "cli", "tui", "config", "scripts", "tests")


def _texts() -> list[tuple[Path, str]]:
    files = [p for d in SOURCES for p in (ROOT / d).rglob("*.py")]
    files.append(ROOT / "README.md")
    return [(p, p.read_text(encoding="utf-8")) for p in files]


def _sections() -> set[str]:
    return set(re.findall(r"^##+ (\d+(?:\.\d+)?)\.? ", DESIGN.read_text(), flags=re.M))


def test_design_document_has_numbered_sections():
    sections = _sections()
    assert {str(n) for n in range(1, 19)} <= sections
    assert {"8.1", "8.2", "8.3", "8.4"} <= sections


def test_every_design_pointer_names_a_section_of_docs_design():
    """A docstring that cites the design cites ``docs/DESIGN.md §N`` with N a section of
    that file: never a bare ``DESIGN.md``, a file outside the repo, or a missing section."""
    sections = _sections()
    this = Path(__file__).resolve()
    wrong = []
    for path, text in _texts():
        if path == this:
            continue
        for m in re.finditer(r"(\S*)DESIGN(\.md)?( §\s*[\d.]+)?", text):
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            prefix, ref = m.group(1), m.group(3)
            if not prefix.endswith("docs/") and "[docs/DESIGN.md]" not in m.group(0):
                wrong.append(f"{where}: {m.group(0)!r} is not docs/DESIGN.md")
            elif ref and ref.strip(" §").rstrip(".") not in sections:
                wrong.append(f"{where}: {m.group(0)!r} names no section of docs/DESIGN.md")
    assert not wrong, "\n".join(wrong)


def test_design_paths_resolve_and_its_layout_names_every_subpackage():
    """Every source path docs/DESIGN.md names exists; §1's table has a row for each
    subpackage of core/, and every module that row names is in it."""
    text = DESIGN.read_text()
    missing = [
        m.group(1)
        for m in re.finditer(r"`((?:core|cli|tui|config|tests|scripts)/[\w/.]+?\.py)`", text)
        if not (ROOT / m.group(1)).exists()
    ]
    rows = dict(re.findall(r"^\| `(core/\w+/)` \|(.*)$", text, flags=re.M))
    for folder, row in rows.items():
        missing += [
            folder + n for n in re.findall(r"`(\w+\.py)`", row) if not (ROOT / folder / n).exists()
        ]
    packages = {
        f"core/{p.name}/" for p in (ROOT / "core").iterdir() if (p / "__init__.py").exists()
    }
    assert not missing, missing
    assert packages <= set(rows), sorted(packages - set(rows))


def test_no_pointer_to_a_file_outside_the_repo():
    outside = re.compile(r"\.\./shared/|/work/shared|(?<![\w/])STYLE\.md")
    hits = [str(p.relative_to(ROOT)) for p, text in _texts() if outside.search(text)]
    hits = [h for h in hits if h != "tests/unit/test_house.py"]
    assert not hits, hits


def test_cli_tui_and_config_import_absolutely():
    """``from tierchat.x import ...``, never ``from .x`` (one style; core/ has its own,
    below)."""
    relative = []
    for d in ("cli", "tui", "config"):
        for path in sorted((ROOT / d).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.level:
                    relative.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not relative, relative


def test_core_imports_relatively():
    """core/ imports its own modules one way, relatively (``from .api import ...``,
    ``from ..config.settings import ...``): never ``tierchat.`` by name."""
    absolute = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(n == "tierchat" or n.startswith("tierchat.") for n in names):
                absolute.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not absolute, absolute


def test_one_home_for_size_count_and_duration_formatters():
    """No module but core/units.py defines a byte, count or duration formatter."""
    name = re.compile(r"^_?(fmt|format|human)_(bytes|size|count|seconds|ms|duration)\w*$")
    found = []
    for d in ("core", "cli", "tui", "config"):
        for path in sorted((ROOT / d).rglob("*.py")):
            if path == ROOT / "core" / "units.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef) and name.match(node.name):
                    found.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not found, found


def _longer_than(folders: tuple[str, ...], limit: int) -> list[str]:
    """``path: N lines`` for each .py file under ``folders`` of more than ``limit`` lines."""
    long = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > limit:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                long.append(f"{where}: {n} lines")
    return long


def test_no_module_in_core_or_tui_is_over_600_lines():
    """A core or TUI module is read in one sitting; new work goes in a new module of one
    responsibility rather than a longer file (docs/DESIGN.md §1)."""
    assert not _longer_than(("core", "tui"), 600)


def test_the_length_check_can_fail(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * 600, encoding="utf-8")
    (tmp_path / "long.py").write_text("x = 1\n" * 601, encoding="utf-8")
    assert _longer_than((str(tmp_path),), 600) == [f"{tmp_path / 'long.py'}: 601 lines"]


def test_no_module_in_cli_is_over_1000_lines():
    assert not _longer_than(("cli",), 1000)


def test_code_cites_the_design_not_issue_numbers():
    """Docstrings and comments point a reader at docs/DESIGN.md sections; an issue number
    is a page the reader of the code cannot open."""
    pattern = re.compile(r"\bissues? #?\d+\b", re.IGNORECASE)
    found = []
    for folder in ("core", "cli", "tui", "config"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_cli_holds_no_http_route_or_server():
    """The server (routes, SSE, guards, its thread) is a library module of its own
    (core/serve/app.py); cli/ parses arguments and dispatches."""
    found = []
    for path in sorted((ROOT / "cli").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in (
                    "Route",
                    "Starlette",
                    "uvicorn.Server",
                    "uvicorn.Config",
                    "uvicorn.run",
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}(...)")
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if any(b in ("uvicorn.Server", "Starlette", "threading.Thread") for b in bases):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: class {node.name}")
    assert not found, "\n".join(found)


def _core_imports() -> dict[str, set[str]]:
    """Module -> the core modules it imports, lazy imports inside functions included."""
    core = ROOT / "core"
    modules = {}
    for path in core.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        tree = ast.parse(path.read_text())
        typing_only = {  # `if TYPE_CHECKING:` imports never run
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = package[: len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            for alias in node.names:
                full = ".".join([*target, alias.name])
                dep = full if full in modules else ".".join(target)
                if dep in modules and dep != name:
                    deps.add(dep)
        graph[name] = deps
    return graph


def test_no_import_cycle_inside_core():
    """No module of core/ reaches itself through its imports (a lazy import inside a
    function that hides a cycle is still one; annotations under ``TYPE_CHECKING`` are not
    imports)."""
    graph = _core_imports()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


PACKAGES = {"core": "tierchat.core", "cli": "tierchat.cli", "tui": "tierchat.tui"}
PACKAGES["config"] = "tierchat.config"


class Import(NamedTuple):
    """One import in a source file: the module's absolute name (``tierchat.core.api``,
    ``mlx.core``; ``from x import y`` gives ``x.y``), where, and whether it runs when the
    file is imported (``top``: not inside a function, not under ``TYPE_CHECKING``)."""

    module: str
    where: str
    typing_only: bool
    top: bool


def _imports(path: Path) -> list[Import]:
    """Every import of ``path`` (lazy ones in functions and ``TYPE_CHECKING`` ones
    included), relative ones resolved against the file's package."""
    rel = path.relative_to(ROOT)
    package = [PACKAGES[rel.parts[0]], *rel.parts[1:-1]]  # the file's folder
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) in _TYPING
        for n in ast.walk(block)
    }
    lazy = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for n in ast.walk(f)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = ".".join(package).split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        typing, top = id(node) in typing_only, id(node) not in typing_only | lazy
        where = f"{rel}:{node.lineno}"
        found += [Import(n, where, typing, top) for n in names]
    return found


_TYPING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _layer_breaches(folder: str, banned: tuple[str, ...]) -> list[str]:
    """``path:line: module`` for each import under ``folder`` (lazy and ``TYPE_CHECKING``
    ones included) of a module in ``banned`` or below it."""
    return [
        f"{i.where}: {i.module}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for i in _imports(path)
        if any(i.module == b or i.module.startswith(b + ".") for b in banned)
    ]


# What tui/ may not import: MLX, and every core module that does or that is the engine's
# (it reaches the engine as an EngineLike, docs/DESIGN.md §1, §16)
TUI_BANNED = ("mlx", "mlx_lm", "tierchat.core.engine", "tierchat.core.device")
TUI_BANNED += (
    "tierchat.core.cache",
    "tierchat.core.models",
    "tierchat.core.memory",
    "tierchat.cli",
)


def test_core_and_config_import_neither_the_tui_nor_the_cli_nor_textual():
    """The layers point one way (docs/DESIGN.md §1): core/ and config/ never import
    Textual, tui/ or cli/, not even lazily or for a type annotation."""
    banned = ("textual", "tierchat.tui", "tierchat.cli")
    assert not _layer_breaches("core", banned) + _layer_breaches("config", banned)


def test_the_tui_imports_no_mlx_and_no_engine_internals():
    """tui/ never imports MLX, nor core's engine, device, cache, models or memory, nor cli/
    (docs/DESIGN.md §1): not lazily, not under ``TYPE_CHECKING``."""
    assert not _layer_breaches("tui", TUI_BANNED)


def test_the_core_modules_the_tui_imports_load_no_mlx():
    """Whatever core/ module tui/ imports loads no MLX when imported: its imports that
    run at import time, followed through core/, reach no ``mlx`` module."""
    graph: dict[str, list[Import]] = {}
    for path in (ROOT / "core").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        graph[".".join([PACKAGES["core"], *parts[1:]])] = _imports(path)

    def loads(module: str) -> str:
        """The chain from ``module`` to an MLX import, or ""."""
        seen, todo = set(), [(module, module)]
        while todo:
            name, chain = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for i in graph.get(name, ()):
                if not i.top:
                    continue
                if i.module.split(".")[0] in ("mlx", "mlx_lm"):
                    return f"{chain} -> {i.module}"
                target = i.module if i.module in graph else i.module.rpartition(".")[0]
                if target in graph:
                    todo.append((target, f"{chain} -> {target}"))
        return ""

    used = {
        i.module if i.module in graph else i.module.rpartition(".")[0]
        for path in (ROOT / "tui").rglob("*.py")
        for i in _imports(path)
        if i.module.startswith(PACKAGES["core"] + ".")
    }
    chains = [c for c in map(loads, sorted(used)) if c]
    assert not chains, "\n".join(chains)
    assert loads("tierchat.core.engine.engine")  # the check follows a chain to MLX


def test_the_layer_checks_see_lazy_and_type_checking_imports(tmp_path, monkeypatch):
    tui = tmp_path / "tui"
    tui.mkdir()
    (tui / "m.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from tierchat.core.engine.engine import Engine\n"
        "def f():\n    import mlx.core as mx\n    from ..core import device\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = _layer_breaches("tui", TUI_BANNED)
    assert [f.split(": ")[1] for f in found] == [
        "tierchat.core.engine.engine.Engine",
        "mlx.core",
        "tierchat.core.device",
    ]


def _tier_reaches(paths: list[Path]) -> list[str]:
    """``path:line: .attr`` for each attribute ``hot``, ``ssd`` or ``rates`` read in
    ``paths`` (``cache.hot.nbytes``, ``self.cache.ssd``, an alias's ``.rates``)."""
    tiers = {"hot", "ssd", "rates"}
    reaches = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in tiers:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                reaches.append(f"{where}:{node.lineno}: .{node.attr}")
    return reaches


def test_the_engine_reaches_no_cache_tier():
    """core/engine/ asks the prefix cache through its own methods (``fit_hot_budget``,
    ``ssd_warning``, ``hold_writes``, ``observe_prefill``, ``release_ram``...), never
    through its tiers: no attribute ``hot``, ``ssd`` or ``rates`` is read there
    (``cache.hot.nbytes``, ``self.cache.ssd``, an alias's ``.rates``; docs/DESIGN.md §2)."""
    assert not _tier_reaches(sorted((ROOT / "core" / "engine").rglob("*.py")))


def test_the_cache_request_planner_and_capture_see_only_their_seams():
    """``CacheRequest`` sees only ``PrefixCache`` (``hold_writes``, ``observe_read``...),
    the planner and the capture only a ``TierView`` (docs/DESIGN.md §9): none of them
    reads a tier (``cache.ssd``, ``view.hot``, ``cache.rates``)."""
    parts = ("request.py", "planner.py", "capture.py", "view.py")
    assert not _tier_reaches([ROOT / "core" / "cache" / p for p in parts])


def test_the_tier_reach_check_can_fail(tmp_path):
    (tmp_path / "m.py").write_text(
        "def f(cache):\n    cache.ssd.pause(1)\n    return cache.hold_writes(1)\n",
        encoding="utf-8",
    )
    assert _tier_reaches([tmp_path / "m.py"]) == ["m.py:2: .ssd"]


def _private_reaches(folder: Path) -> list[str]:
    """``path:line: expr`` for each ``x._name`` under ``folder`` whose ``x`` is not the
    object's own (``self``, ``cls``, ``super()``): another object's or module's private
    member, read, written or called (dunders apart)."""
    reaches = []
    for path in [folder] if folder.is_file() else sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__") and node.attr.endswith("__"):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and ast.unparse(base.func) == "super":
                continue
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            reaches.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return reaches


def test_the_engine_reaches_into_no_private_member_of_another_object():
    """core/engine/'s modules meet through public seams: the executor, the runtime, the
    request and the peers (docs/DESIGN.md §2, §20); no ``engine._load``,
    ``self.engine._attention`` or ``mod._helper`` across modules."""
    assert not _private_reaches(ROOT / "core" / "engine")


# mlx-lm's RotatingKVCache keeps its write index only in ``_idx`` (its ``state`` tuple
# changed shape across versions); core/cache/layers.py is the one adapter of mlx-lm's
# cache classes (docs/DESIGN.md §5), so it alone may read and set it
MLX_LM_INTERNALS = {"core/cache/layers.py": "c._idx"}


def test_the_cache_reaches_into_no_private_member_of_another_object():
    """core/cache/'s modules meet through public seams (the prefix cache's methods, the
    ``TierView``, the SSD tier's): no ``cache._unsaved``, ``ssd._index`` or
    ``tier._drop`` across modules (docs/DESIGN.md §9); mlx-lm's rotating cache index in
    its adapter is the one exception (:data:`MLX_LM_INTERNALS`)."""
    found = []
    for reach in _private_reaches(ROOT / "core" / "cache"):
        where, _, expr = reach.partition(": ")
        if MLX_LM_INTERNALS.get(where.rsplit(":", 1)[0]) != expr:
            found.append(reach)
    assert not found, "\n".join(found)


def test_the_collaborators_split_off_their_hosts_reach_into_no_private_member():
    """The prefix cache's restores, the SSD tier's reads and the conversation store's
    search, import and undo rows are collaborators given what they need (a ``Database``,
    the tiers, the tier's lock and index), not code that reads its host's ``_private``
    members (docs/DESIGN.md §1, §9, §12)."""
    parts = ("cache/restore.py", "cache/ssd/reader.py", "chat/search.py", "chat/importer.py")
    parts += ("chat/trash.py", "chat/sqlite.py")
    assert not [r for part in parts for r in _private_reaches(ROOT / "core" / part)]


def test_the_private_reach_check_can_fail(tmp_path):
    (tmp_path / "m.py").write_text(
        "def f(engine, mod):\n    engine._load()\n    return mod._x + self._ok\n",
        encoding="utf-8",
    )
    found = [line.split(": ")[-1] for line in _private_reaches(tmp_path)]
    assert found == ["engine._load", "mod._x"]
