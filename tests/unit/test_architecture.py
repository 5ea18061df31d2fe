"""The package's shape (docs/architecture.md): imports run one way between the rooms, no module or function grows
past what a reader takes in at once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "meshforge"
DOC = SRC.parents[1] / "docs" / "architecture.md"
FLOORS = {
    "paths": -1,  # the ground (paths, errors): import nothing from meshforge, so every room may use them
    "errors": -1,
    "threads": 0,  # background workers that never fail silently (uses errors)
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


def module_of(path: Path, root: Path = SRC) -> str:
    """``meshforge.a.b`` for a/b.py under ``root`` (src/meshforge); a package's __init__.py is the package itself."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(("meshforge", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """File -> the meshforge files it imports at run time (inside functions too; ``if TYPE_CHECKING:`` aside).
    ``from pkg import name`` is an edge to pkg/name.py when that is a module, else to the package; the implicit import
    of a parent package by its submodules is no edge (a package's __init__ re-exporting its modules is no loop)."""
    files = {module_of(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        for node in _runtime_import_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshforge"):
                subs = {f"{node.module}.{a.name}" for a in node.names}
                edges |= {sub if sub in files else node.module for sub in subs}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def _runtime_import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module (inside functions too) outside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skipped]


def file_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted: every file loop lies in one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


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


def test_no_file_level_import_cycle() -> None:
    """No two files of src/meshforge import each other, directly or around a loop, at run time (imports inside
    functions count: they hide a loop, they do not break it; type-only imports aside)."""
    cycles = " ; ".join(" <-> ".join(c) for c in file_cycles(import_graph()))
    assert not cycles, f"file-level import cycles (break each at its cause): {cycles}"


def test_the_cycle_check_sees_a_loop_inside_functions(tmp_path: Path) -> None:
    """The cycle check is not vacuous: a loop closed by an import inside a function is found, one closed only under
    ``if TYPE_CHECKING:`` is not, and a package __init__ re-exporting its module is no loop."""
    pkg = tmp_path / "meshforge"
    (pkg / "room").mkdir(parents=True)
    (pkg / "room" / "__init__.py").write_text("from meshforge.room.b import g\n")
    (pkg / "room" / "a.py").write_text("from meshforge.room import b\n")
    (pkg / "room" / "b.py").write_text("def g():\n    from meshforge.room.a import b\n")
    (pkg / "room" / "c.py").write_text("from meshforge.room import d\n")
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import meshforge.room.c\n"
    (pkg / "room" / "d.py").write_text(type_only)
    graph = import_graph(pkg)
    assert graph["meshforge.room.b"] == {"meshforge.room.a"}
    assert file_cycles(graph) == [["meshforge.room.a", "meshforge.room.b"]]


def documented_modules(text: str) -> set[str]:
    """Paths under src/meshforge that docs/architecture.md's tree (its first code block) names: a folder line
    (``  room/`` or, indented two more per level, ``    sub/``) opens a folder whose text runs until the next folder
    or top-level file line; every ``name.py`` in that text is ``folder/name.py``."""
    block = text.split("```", 2)[1]
    found: set[str] = set()
    folders: list[str] = []
    for line in block.splitlines():
        indent, words = len(line) - len(line.lstrip()), line.split()
        if not words or not 2 <= indent <= 12 or indent % 2:
            pass  # a continuation line (aligned with the descriptions) stays in the current folder
        elif re.fullmatch(r"\w+/", words[0]):
            folders = [*folders[: indent // 2 - 1], words[0]]
        elif indent == 2:
            folders = []
        prefix = "".join(folders)
        found |= {prefix + name for name in re.findall(r"\b\w+\.py\b", line)}
    return found


def test_every_module_is_named_in_the_architecture_doc() -> None:
    """A newcomer finds every module in docs/architecture.md's tree, in its folder (a package's __init__ is named by
    its folder)."""
    named = documented_modules(DOC.read_text())
    folders = {name.rsplit("/", 1)[0] + "/" for name in named if "/" in name}
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if path.name == "__init__.py":
            if rel != "__init__.py" and rel.rsplit("/", 1)[0] + "/" not in folders and rel not in named:
                missing.append(rel)
        elif rel not in named:
            missing.append(rel)
    assert not missing, f"modules docs/architecture.md's tree does not name (add them to their room): {missing}"


def test_the_doc_check_reads_folders() -> None:
    """The doc parser files names under their folder, nested folders included, and top-level files at the top."""
    tree = "x\n```\nsrc/meshforge/\n  cli.py   the CLI\n  room/    a.py (the a), b.py,\n           c.py\n"
    tree += "    sub/   d.py\n  other/   e.py\n  f.py     last\n```\n"
    assert documented_modules(tree) == {
        "cli.py",
        "room/a.py",
        "room/b.py",
        "room/c.py",
        "room/sub/d.py",
        "other/e.py",
        "f.py",
    }


ORDER_WORDS = {
    "apply_float8": "Float8 conversion",
    "apply_tp": "tensor/sequence parallel",
    "apply_ep": "expert parallel",
    "apply_cp": "context parallel",
    "apply_ac": "activation checkpointing",
    "apply_compile": "torch.compile",
    "apply_fsdp": "FSDP/HSDP",
}


def test_the_documented_parallelize_order_is_the_code_s() -> None:
    """docs/architecture.md's order (and parallelize.py's docstring) list the strategies as parallelize() applies
    them."""
    source = (SRC / "parallel" / "parallelize.py").read_text()
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "parallelize")
    calls = [n for n in ast.walk(body) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    applied = [ORDER_WORDS[c.func.id] for c in sorted(calls, key=lambda c: c.lineno) if c.func.id in ORDER_WORDS]  # type: ignore[attr-defined]
    assert len(applied) == len(ORDER_WORDS), applied
    section = DOC.read_text().split("## The parallelize order", 1)[1].split("\n## ", 1)[0]
    for text in (section, ast.get_docstring(ast.parse(source)) or ""):
        block = " ".join(" ".join(line.split()) for line in text.splitlines() if line.startswith("    "))
        documented = sorted((block.find(w), w) for w in ORDER_WORDS.values() if w in block)
        assert [w for _, w in documented] == applied, f"documented {block!r}, applied {applied}"
