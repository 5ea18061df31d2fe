"""`make test-mutants-sample` (scripts/mutants_sample.py): its operator set over the AST, the changed lines it reads
from git, and the unit tests it picks for a module (fast: no mutant is run here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SOURCE = '''"""A module: 1 < 2 in its docstring is never mutated."""
from typing import TYPE_CHECKING, Annotated

if TYPE_CHECKING:
    LIMIT = 1 + 2
SIZE: Annotated[int, 5] = 6


def loss(head: "Head", hidden: Annotated[int, 7] = 3, chunks: int = 8) -> float:
    """Docstring: x / y."""
    if not hidden < chunks and chunks == 2:
        return head(hidden).float().sum() / chunks
    return max(hidden - chunks, 0) or clip(hidden, chunks)
'''


def tool():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("mutants_sample", REPO / "scripts" / "mutants_sample.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutants_sample"] = module
    spec.loader.exec_module(module)
    return module


def test_the_operator_set_makes_each_kind_of_one_line_bug_and_nothing_else() -> None:
    sites = list(tool().mutations("m.py", SOURCE))
    made = {(s.line, s.operator, s.after.strip()) for s in sites}
    for want in [
        (11, "removed not", "if hidden < chunks and chunks == 2:"),
        (11, "comparison Lt -> LtE", "if not hidden <= chunks and chunks == 2:"),
        (11, "comparison Eq -> NotEq", "if not hidden < chunks and chunks != 2:"),
        (11, "and -> or", "if not hidden < chunks or chunks == 2:"),
        (11, "constant 2 -> 3", "if not hidden < chunks and chunks == 3:"),
        (12, "dropped .float()", "return head(hidden).sum() / chunks"),
        (12, "operator Div -> Mult", "return head(hidden).float().sum() * chunks"),
        (13, "operator Sub -> Add", "return max(hidden + chunks, 0) or clip(hidden, chunks)"),
        (13, "first two arguments swapped", "return max(hidden - chunks, 0) or clip(chunks, hidden)"),
        (13, "or -> and", "return max(hidden - chunks, 0) and clip(hidden, chunks)"),
        (6, "constant 6 -> 7", "SIZE: Annotated[int, 5] = 7"),
        (9, "constant 8 -> 9", 'def loss(head: "Head", hidden: Annotated[int, 7] = 3, chunks: int = 9) -> float:'),
    ]:
        assert want in made, want
    assert {s.line for s in sites} <= {6, 9, 11, 12, 13}, "a docstring or a TYPE_CHECKING block was mutated"
    assert not [s.after for s in sites if "Annotated[int, 7]" not in s.after and s.line == 9], "an argument annotation"
    assert not [s.after for s in sites if "Annotated[int, 5]" not in s.after and s.line == 6], "a variable annotation"
    lines = SOURCE.splitlines()
    for s in sites:  # each a one-line change that compiles
        changed = [i for i, (a, b) in enumerate(zip(lines, s.source.splitlines(), strict=True)) if a != b]
        assert changed == [s.line - 1], s
        compile(s.source, "m.py", "exec")


def test_the_draw_prefers_the_changed_lines_and_repeats_with_the_seed(tmp_path: Path) -> None:
    mod = tool()
    (tmp_path / "m.py").write_text(SOURCE)
    first = mod.draw(tmp_path, {"m.py": {12}}, 2, seed=5)
    assert [s.line for s in first] == [12, 12]
    assert [s.after for s in mod.draw(tmp_path, {"m.py": {12}}, 2, seed=5)] == [s.after for s in first]
    spread = mod.draw(tmp_path, {"m.py": {11, 12}}, 3, seed=2)  # every changed line once before any twice
    assert sorted(s.line for s in spread[:2]) == [11, 12] and spread[2].line in (11, 12)
    assert len(mod.draw(tmp_path, {"m.py": set()}, 100, seed=1)) == len(list(mod.mutations("m.py", SOURCE)))


def test_a_modules_tests_are_the_unit_files_that_import_it(tmp_path: Path) -> None:
    mod = tool()
    unit = tmp_path / "tests" / "unit"
    unit.mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "sub").mkdir(parents=True)
    for name in ("src/pkg/sub/a.py", "src/pkg/sub/__init__.py", "src/pkg/b.py"):
        (tmp_path / name).write_text("X = 1\n")
    files = {
        "test_from_package.py": "from pkg.sub import a\n",
        "test_import_as.py": "import pkg.sub.a as q\n",
        "test_from_module.py": "def test():\n    from pkg.sub.a import X\n",  # a lazy import counts
        "test_other.py": "from pkg import b\n",
        "test_package.py": "from pkg.sub import X\n",
    }
    for name, text in files.items():
        (unit / name).write_text(text)
    got = mod.tests_of(tmp_path, ["src/pkg/sub/a.py", "src/pkg/sub/__init__.py", "src/pkg/b.py"])
    assert got["src/pkg/sub/a.py"] == [
        f"tests/unit/{n}" for n in ("test_from_module.py", "test_from_package.py", "test_import_as.py")
    ]
    assert got["src/pkg/sub/__init__.py"] == ["tests/unit/test_from_package.py", "tests/unit/test_package.py"]
    assert got["src/pkg/b.py"] == ["tests/unit/test_other.py"]
    assert len(mod.tests_of(tmp_path, ["src/pkg/sub/a.py"], most=1)["src/pkg/sub/a.py"]) == 1


def test_the_change_is_the_lines_git_diff_adds_against_the_base(tmp_path: Path) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text("a = 1\nb = 2\nc = 3\n")
    (tmp_path / "src" / "n.py").write_text("z = 1\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "one"]):
        subprocess.run([*git, *args], cwd=tmp_path, check=True, capture_output=True)
    (tmp_path / "src" / "m.py").write_text("a = 1\nb = 20\nc = 3\nd = 4\n")
    (tmp_path / "README").write_text("not a module\n")
    assert tool().changed_lines(tmp_path, "HEAD") == {"src/m.py": {2, 4}}
