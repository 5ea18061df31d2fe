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
