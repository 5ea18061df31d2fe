"""`make test-mutants`: plant each curated mutant of tests/mutants/*.toml, run the tests mapped to it, print survivors.

Each ``[[mutant]]`` table names a ``file`` (relative to the repository root), a ``find`` text that must occur exactly
once in it, the buggy ``replace`` text, the pytest node ids (``tests``) that must fail on it, and ``why`` (the realistic
bug). The working tree is never touched: the tracked and untracked, not ignored files are copied once into a temporary
folder (``meshforge-mutants-*`` in the system temp folder, removed at the end, Ctrl-C included), each mutant is
written into that copy, its tests run there (``PYTHONPATH`` = the copy's ``src``), and the file is restored.

A mutant is *killed* when its tests fail (pytest exit 1; a timeout counts as killed but is reported as such: a hang
is a poor way to catch a bug). First the union of all selected tests runs on the unmutated copy (``--no-baseline``
skips it): a test that fails there would "kill" every mutant for nothing. Exit status: 0 when every mutant is killed,
1 on a survivor or a mutant whose tests could not run (pytest exit 2-5: unknown node id, no tests collected), 2 on an
invalid list (a ``find`` that does not occur exactly once, a missing key or file, a duplicate name).

    python scripts/mutants.py                 # every mutant of every tests/mutants/*.toml
    python scripts/mutants.py --only ring,tps # the mutants whose name contains "ring" or "tps"
    python scripts/mutants.py --list          # validate and list, run nothing
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEYS = ("name", "file", "find", "replace", "tests", "why")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    why: str
    source: str  # the toml file it came from


class ListError(ValueError):
    """The mutant list is invalid (one line per problem)."""


def parse(path: Path) -> list[Mutant]:
    """The ``[[mutant]]`` tables of one toml file (ListError on a missing or mistyped key)."""
    data = tomllib.loads(path.read_text())
    unknown = set(data) - {"mutant"}
    if unknown:
        raise ListError(f"{path.name}: unknown top-level keys {sorted(unknown)} (only [[mutant]] tables)")
    out = []
    for i, table in enumerate(data.get("mutant", [])):
        where = f"{path.name} mutant {i + 1} ({table.get('name', '?')})"
        missing = [k for k in KEYS if k not in table]
        extra = sorted(set(table) - set(KEYS))
        if missing or extra:
            raise ListError(f"{where}: missing keys {missing}, unknown keys {extra}")
        tests = table["tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t for t in tests):
            raise ListError(f"{where}: tests must be a non-empty list of pytest node ids")
        if not all(isinstance(table[k], str) for k in ("name", "file", "find", "replace", "why")):
            raise ListError(f"{where}: name, file, find, replace and why must be strings")
        if table["find"] == table["replace"]:
            raise ListError(f"{where}: replace equals find (no mutation)")
        out.append(Mutant(**{k: table[k] for k in KEYS if k != "tests"}, tests=tuple(tests), source=path.name))
    return out


def validate(mutants: list[Mutant], root: Path) -> list[str]:
    """Problems of the list against the tree at ``root``: duplicate names, missing files, a ``find`` that does not occur
    exactly once, a test file that does not exist."""
    problems = []
    seen: dict[str, str] = {}
    for m in mutants:
        if m.name in seen:
            problems.append(f"{m.source}: mutant name {m.name!r} already used in {seen[m.name]}")
        seen[m.name] = m.source
        target = root / m.file
        if not target.is_file():
            problems.append(f"{m.source} {m.name}: file {m.file} does not exist")
            continue
        count = target.read_text().count(m.find)
        if count != 1:
            problems.append(f"{m.source} {m.name}: find occurs {count} times in {m.file} (must be exactly once)")
        for test in m.tests:
            if not (root / test.split("::", 1)[0]).is_file():
                problems.append(f"{m.source} {m.name}: test file of {test} does not exist")
    return problems


def load_all(root: Path) -> list[Mutant]:
    """Every mutant of every ``tests/mutants/*.toml`` under ``root``, in file then table order."""
    mutants: list[Mutant] = []
    for path in sorted((root / "tests" / "mutants").glob("*.toml")):
        mutants += parse(path)
    return mutants


def copy_tree(root: Path, dest: Path) -> None:
    """Copy the tracked and the untracked, not ignored files of ``root`` (git's view of the working tree)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        rel = raw.decode()
        if rel and (root / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, dest / rel)


def pytest(copy: Path, tests: list[str], timeout: float) -> tuple[int | None, str]:
    """(pytest's exit code or None on timeout, its output's tail) for ``tests`` run in the copy."""
    env = dict(os.environ, PYTHONPATH=str(copy / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, ""
    return done.returncode, (done.stdout + done.stderr)[-2000:]


def run_mutant(m: Mutant, copy: Path, timeout: float) -> tuple[str, float]:
    """Plant ``m`` in the copy, run its tests, restore the file: ('killed' | 'killed (timeout)' | 'SURVIVED' | 'error
    ...', seconds)."""
    target = copy / m.file
    original = target.read_text()
    start = time.perf_counter()
    try:
        target.write_text(original.replace(m.find, m.replace, 1))
        code, tail = pytest(copy, list(m.tests), timeout)
    finally:
        target.write_text(original)
    seconds = time.perf_counter() - start
    if code is None:
        return "killed (timeout)", seconds
    if code == 1:
        return "killed", seconds
    if code == 0:
        return "SURVIVED", seconds
    return f"error (pytest exit {code}):\n{tail}", seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--only", default="", help="only the mutants whose name contains one of these (comma-separated)")
    ap.add_argument("--list", action="store_true", help="validate and list the mutants, run nothing")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of the tests on the unmutated tree")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant's test run (default 600)")
    args = ap.parse_args(argv)
    try:
        mutants = load_all(REPO)
    except (ListError, tomllib.TOMLDecodeError) as exc:
        print(f"invalid mutant list: {exc}")
        return 2
    problems = validate(mutants, REPO)
    if problems:
        print("invalid mutant list:\n  " + "\n  ".join(problems))
        return 2
    chosen = [m for m in mutants if any(part in m.name for part in args.only.split(","))]
    if args.list:
        for m in chosen:
            print(f"{m.source:16} {m.name:36} {m.file}  <- {', '.join(m.tests)}")
        print(f"{len(chosen)} of {len(mutants)} mutants")
        return 0
    return run(chosen, args.no_baseline, args.timeout)


def run(chosen: list[Mutant], no_baseline: bool, timeout: float) -> int:
    """Baseline, then every mutant in a temporary copy of the tree; prints one line each and the survivors."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshforge-mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(REPO, copy)
        if not no_baseline:
            union = sorted({t for m in chosen for t in m.tests})
            code, tail = pytest(copy, union, timeout * 2)
            if code != 0:
                print(f"baseline: the mapped tests fail on the unmutated tree (exit {code}); fix them first\n{tail}")
                return 1
            print(f"baseline: {len(union)} tests pass on the unmutated tree ({time.perf_counter() - start:.0f} s)")
        results = []
        for m in chosen:
            outcome, seconds = run_mutant(m, copy, timeout)
            results.append((m, outcome))
            print(f"{outcome.split(chr(10))[0]:18} {seconds:6.1f} s  {m.name}  ({m.file})", flush=True)
            if outcome.startswith("error"):
                print(outcome.split("\n", 1)[1])
    bad = [(m, o) for m, o in results if not o.startswith("killed")]
    print(f"{len(results) - len(bad)} of {len(results)} mutants killed in {time.perf_counter() - start:.0f} s")
    for m, outcome in bad:
        print(f"  {outcome.split(chr(10))[0]}: {m.name} ({m.source}): {m.why}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
