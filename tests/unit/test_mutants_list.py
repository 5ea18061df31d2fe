"""The curated mutant list (tests/mutants/*.toml, run by `make test-mutants`) stays valid as the code moves: every
`find` occurs exactly once in its file, names are unique, test files exist; and the runner refuses bad entries."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def runner():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("mutants_runner", REPO / "scripts" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutants_runner"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_curated_mutant_list_is_valid_against_this_tree() -> None:
    mutants = runner().load_all(REPO)
    assert len(mutants) >= 12
    problems = runner().validate(mutants, REPO)
    assert not problems, "\n".join(problems)


def test_the_runner_refuses_a_find_that_is_not_unique_and_a_missing_key(tmp_path: Path) -> None:
    mod = runner()
    (tmp_path / "tests" / "mutants").mkdir(parents=True)
    (tmp_path / "src.py").write_text("a = 1\nb = 1\n")
    (tmp_path / "test_x.py").write_text("")
    entry = 'name = "{name}"\nfile = "src.py"\nfind = "{find}"\nreplace = "= 2"\ntests = ["test_x.py::t"]\nwhy = "w"\n'
    good = "[[mutant]]\n" + entry.format(name="one", find="a = 1")
    twice = "[[mutant]]\n" + entry.format(name="two", find="= 1")
    absent = "[[mutant]]\n" + entry.format(name="three", find="c = 1")
    (tmp_path / "tests" / "mutants" / "x.toml").write_text(good + twice + absent + good)
    problems = mod.validate(mod.load_all(tmp_path), tmp_path)
    assert problems == [
        "x.toml two: find occurs 2 times in src.py (must be exactly once)",
        "x.toml three: find occurs 0 times in src.py (must be exactly once)",
        "x.toml: mutant name 'one' already used in x.toml",
    ]
    (tmp_path / "tests" / "mutants" / "x.toml").write_text(good.replace('why = "w"\n', ""))
    with pytest.raises(mod.ListError, match=r"missing keys \['why'\]"):
        mod.load_all(tmp_path)


def _toy_repo(root: Path) -> None:
    """A git repository with one module, its tests and two mutants: one its tests kill, one they miss."""
    import subprocess

    (root / "src" / "toy").mkdir(parents=True)
    module = "def add(a, b):\n    return a + b\n\n\ndef sign(x):\n    return x > 0\n"
    (root / "src" / "toy" / "__init__.py").write_text(module)
    (root / "tests" / "mutants").mkdir(parents=True)
    (root / "tests" / "test_toy.py").write_text(
        "from toy import add, sign\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_sign():\n    assert sign(2)\n\n\ndef test_broken():\n    assert add(1, 1) == 3\n"
    )
    entry = '[[mutant]]\nname = "{n}"\nfile = "src/toy/__init__.py"\nfind = "{f}"\nreplace = "{r}"\n'
    entry += 'tests = ["tests/test_toy.py::test_add", "tests/test_toy.py::test_sign"]\nwhy = "w"\n'
    lists = entry.format(n="add-subtracts", f="a + b", r="a - b") + entry.format(n="sign-ge", f="x > 0", r="x >= 0")
    broken = entry.format(n="killed-for-nothing", f="return a", r="return  a")  # its test fails unmutated
    lists += broken.replace(
        '["tests/test_toy.py::test_add", "tests/test_toy.py::test_sign"]', '["tests/test_toy.py::test_broken"]'
    )
    (root / "tests" / "mutants" / "toy.toml").write_text(lists)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "toy"]):
        subprocess.run([*git, *args], cwd=root, check=True, capture_output=True)


def test_the_runner_kills_reports_survivors_and_leaves_the_tree_and_temp_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two mutants at a time in forked runs from this process: the killed one, the survivor named, the killing
    tests baselined (one fails unmutated: its mutant is reported), the tree's files and git status unchanged, no
    meshforge-mutants-* folder left."""
    import tempfile

    mod = runner()
    repo = tmp_path / "repo"
    _toy_repo(repo)
    before = mod.snapshot(repo)
    temp = Path(tempfile.gettempdir())
    leftovers = set(temp.glob("meshforge-mutants-*"))
    code = mod.run(mod.load_all(repo), no_baseline=False, timeout=120, jobs=2, root=repo)
    out = capsys.readouterr().out
    assert code == 1, out
    assert "1 of 3 mutants killed" in out and "SURVIVED: sign-ge (toy.toml)" in out, out
    assert "baseline: 2 killing tests on the unmutated tree: 1 fail" in out, out
    assert "killed by a test that fails unmutated: killed-for-nothing" in out, out
    assert mod.snapshot(repo) == before, "the runner touched the tree"
    assert set(temp.glob("meshforge-mutants-*")) == leftovers, "a temporary copy was left behind"


def test_a_restored_module_is_never_imported_from_a_stale_bytecode(tmp_path: Path) -> None:
    """A same-size edit within the same second as the cached .pyc (checked by mtime + size) must not import the old
    text: write_source drops the cache."""
    import py_compile

    mod = runner()
    source = tmp_path / "m.py"
    source.write_text("X = 1\n")
    cached = Path(py_compile.compile(str(source)))
    assert cached.is_file()
    mod.write_source(source, "X = 2\n")
    assert not cached.exists(), "the mutated module's bytecode of its old text survived"
