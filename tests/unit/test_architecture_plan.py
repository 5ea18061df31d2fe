"""plan/'s floors, read from the source (ast): every import of a plan module by another, those inside functions
included (``if TYPE_CHECKING:`` ones aside: they never run), must go down the rooms, and no file-level import cycle
may exist within plan/.

The rooms, bottom up (docs/architecture.md, planner block):

- ground: ``layout``, ``hardware``, ``shipped`` (plan/*.py): the layout a config resolves to, the hardware profiles
  and their shipped constants. They import nothing of plan/'s sub-rooms nor of the top.
- ``physics/``: what a rank holds and computes, its memory and step time; only the ground below it.
- ``search/``: the layout search; physics and the ground.
- ``accuracy/``: the planner against measurements (published rows, fits, leave-one-out, intervals, the exact check);
  search, physics and the ground.
- ``guide/``: the strategy-selection guide; accuracy, search, physics and the ground.
- top: ``cli``, ``report`` (plan/*.py): the command and its text; anything below. Nothing imports them but
  themselves (cli -> report).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_architecture import file_cycles

PLAN = Path(__file__).resolve().parents[2] / "src" / "meshforge" / "plan"
PACKAGE = "meshforge.plan"
GROUND = {"layout", "hardware", "shipped"}
TOP = {"cli", "report"}
ROOMS = ("ground", "physics", "search", "accuracy", "guide", "top")
"""Bottom up: a module may import from its own room and the rooms before it."""


def module_name(path: Path) -> str:
    """``meshforge.plan.physics.estimate`` for plan/physics/estimate.py (a package: its __init__'s name)."""
    parts = path.relative_to(PLAN).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def room(module: str) -> str:
    """The room of a plan module name (``meshforge.plan`` itself: the ground, it is empty)."""
    parts = module.split(".")[2:]
    if not parts:
        return "ground"
    if parts[0] in ROOMS[1:-1]:
        return parts[0]
    if parts[0] in GROUND:
        return "ground"
    if parts[0] in TOP:
        return "top"
    raise AssertionError(f"{module}: plan/{parts[0]} belongs to no room; add it to GROUND, TOP or a sub-package")


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers of every statement under ``if TYPE_CHECKING:`` (imports there never run)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def plan_imports(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    """(line, imported plan module) for every import in ``path`` that runs: top level or inside a function."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_lines(tree)
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith(PACKAGE)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if not base.startswith(PACKAGE):
                continue
            for a in node.names:  # ``from meshforge.plan.physics import comm`` imports the module comm
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in modules else base))
    return out


def graph() -> dict[str, list[tuple[int, str]]]:
    """Every plan module -> the plan modules it imports (line, module), the package itself left out."""
    files = sorted(PLAN.rglob("*.py"))
    modules = {module_name(p) for p in files}
    return {module_name(p): [(n, m) for n, m in plan_imports(p, modules) if m != PACKAGE] for p in files}


def test_every_plan_import_goes_down_the_rooms() -> None:
    """physics imports no search/accuracy/guide/top; search no accuracy/guide/top; ... (the module docstring)."""
    bad = []
    for module, imports in graph().items():
        mine = ROOMS.index(room(module))
        for line, target in imports:
            if ROOMS.index(room(target)) > mine:
                bad.append(f"{module}:{line} imports {target} ({room(module)} may not import {room(target)})")
    assert not bad, "plan/ imports against its floors:\n" + "\n".join(bad)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every loop of modules (the house-wide finder, tests/unit/test_architecture.py) and a module importing itself."""
    return file_cycles(edges) + [[v] for v in sorted(edges) if v in edges[v]]


def test_no_import_cycle_within_plan() -> None:
    """No loop of plan files importing each other, imports inside functions included (type-only ones aside)."""
    edges = {m: {t for _, t in imports} for m, imports in graph().items()}
    assert not cycles(edges), f"import cycles within plan/: {cycles(edges)}"


def test_the_cycle_finder_finds_a_function_level_loop() -> None:
    """The detector itself: a two-file loop and a three-file loop are found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []
    assert cycles({"a": {"a", "b"}, "b": set()}) == [["a"]]  # a module importing itself


def test_plan_top_level_has_at_most_ten_rooms() -> None:
    """plan/ holds at most 10 entries at its top level (files and folders, caches aside)."""
    entries = [p.name for p in PLAN.iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 10, sorted(entries)
    for sub in ROOMS[1:-1]:
        assert (PLAN / sub / "__init__.py").is_file(), sub
