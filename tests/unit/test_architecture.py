"""The package's shape (docs/architecture.md): imports run one way between the rooms, no module or function grows
past what a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "meshforge"
FLOORS = {
    "paths": -1,  # the ground (paths, errors): import nothing from meshforge, so every room may use them
    "errors": -1,
    "device": 0,
    "model": 0,
    "config": 1,
    "data": 2,
    "parallel": 2,
    "checkpoint": 3,
    "observability": 3,
    "tools": 4,
    "train": 5,
    "plan": 6,
    "bench": 7,
    "cli": 8,
}
"""Lower floors never import higher ones at run time; rooms on one floor do not import each other."""
MAX_LINES, MAX_FUNCTION = 450, 60


def room(module: str) -> str:
    """The subpackage (or top-level module) a module lives in; ``__main__`` belongs with ``cli``."""
    name = module.split(".")[1]
    return "cli" if name == "__main__" else name


def runtime_imports(path: Path) -> set[str]:
    """meshforge modules ``path`` imports outside ``if TYPE_CHECKING:`` blocks (lazy imports inside functions too)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshforge."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("meshforge.")}
    return found


def modules() -> dict[str, Path]:
    return {
        "meshforge." + ".".join(p.relative_to(SRC).with_suffix("").parts): p
        for p in SRC.rglob("*.py")
        if p.name != "__init__.py" or p.stat().st_size
    }


def test_imports_run_one_way() -> None:
    wrong = []
    for name, path in modules().items():
        here = room(name)
        assert here in FLOORS, f"{name}: room {here!r} has no floor in this test; add it (and to docs/architecture.md)"
        for target in runtime_imports(path):
            there = room(target)
            if there != here and FLOORS[there] >= FLOORS[here]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports that go up or sideways: " + ", ".join(sorted(wrong))


def test_training_never_imports_the_planner_or_bench() -> None:
    for name, path in modules().items():
        if room(name) in ("plan", "bench", "cli"):
            continue
        assert not {room(t) for t in runtime_imports(path)} & {"plan", "bench"}, name


def test_small_files_and_functions() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    long_files = [f"{name} ({lines})" for name, lines in sizes.items() if lines > MAX_LINES]
    assert not long_files, f"modules over {MAX_LINES} lines: {long_files}; split them by responsibility"
    long_functions = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION:
                    long_functions.append(f"{name}.{node.name} ({length})")
    assert not long_functions, f"functions over {MAX_FUNCTION} lines: {long_functions}"


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The import scan is not vacuous: it finds a planner import and skips one under TYPE_CHECKING."""
    file = tmp_path / "m.py"
    file.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from meshforge.bench import x\n"
        "def f():\n    from meshforge.plan.layout import Layout\n"
    )
    assert runtime_imports(file) == {"meshforge.plan.layout"}
