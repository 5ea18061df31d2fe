"""`make test-mutants`: plant each curated mutant of tests/mutants/*.toml, run the tests mapped to it, print survivors.

Each ``[[mutant]]`` table names a ``file`` (relative to the repository root), a ``find`` text that must occur exactly
once in it, the buggy ``replace`` text, the pytest node ids (``tests``) that must fail on it, and ``why`` (the realistic
bug). The working tree is never touched: the tracked and untracked, not ignored files are copied into a temporary
folder (``meshforge-mutants-*`` in the system temp folder, removed at the end, Ctrl-C included; one copy per
``--jobs``), each mutant is written into a copy, its tests run there (``PYTHONPATH`` = the copy's ``src``, first
failure stops them: ``-x``), and the file's original text is put back and checked by hash; at the end every file of
the tree is checked unchanged by hash and ``git status``. Each run is forked from this process, which imported torch
and the other heavy third-party modules once (never meshforge: that is checked), so a mutant pays for meshforge's
import and its tests only; each mutated file's cached bytecode is dropped when written.

A mutant is *killed* when its tests fail (pytest exit 1; a timeout counts as killed but is reported as such: a hang
is a poor way to catch a bug). The tests that killed a mutant then run on the unmutated copy (``--no-baseline`` skips
it): a test that fails there "kills" mutants for nothing, and those mutants are reported. Only the killing tests run
there, so a slow fallback test listed after a fast one costs nothing while the fast one kills. Exit status: 0 when
every mutant is killed; 1 on a survivor, a mutant whose tests could not run (pytest exit 2-5: unknown node id, no
tests collected), a killing test that fails unmutated, or a tree that changed during the run; 2 on an invalid list
(a ``find`` that does not occur exactly once, a missing key or file, a duplicate name).

    python scripts/mutants.py                 # every mutant of every tests/mutants/*.toml
    python scripts/mutants.py --only ring,tps # the mutants whose name contains "ring" or "tps"
    python scripts/mutants.py --list          # validate and list, run nothing
    python scripts/mutants.py --jobs 1        # one mutant at a time (default 2, each in its own copy)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOBS = 2  # 2 copies at once: 1.5x faster than 1 on 2 loaded cores (measured, docs in tests/mutants/README.md)
KEYS = ("name", "file", "find", "replace", "tests", "why")
PRELOAD = (  # third-party imports every mutant's tests pay for (~3 s of CPU): done once, before the forks
    "numpy", "pytest", "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch.distributed.device_mesh",
    "torch.nn.attention.flex_attention", "torch._inductor.runtime.cache_dir_utils", "torch.testing",
    "torch.testing._internal.distributed.fake_pg", "tokenizers", "safetensors", "tomllib",
)  # fmt: skip


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


def listed_files(root: Path) -> list[str]:
    """The tracked and the untracked, not ignored files of ``root`` (git's view of the working tree)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    return [raw.decode() for raw in listed if raw and (root / raw.decode()).is_file()]


def copy_tree(root: Path, dest: Path) -> None:
    """Copy the files of ``listed_files(root)`` into ``dest``."""
    for rel in listed_files(root):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel)


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file git sees in ``root`` plus its status: equal before and after a run or the tree moved."""
    out = {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in listed_files(root)}
    status = subprocess.run(["git", "status", "--porcelain"], cwd=root, check=True, capture_output=True, text=True)
    out["<git status>"] = status.stdout
    return out


def write_source(path: Path, text: str) -> None:
    """Write a module's text and drop its cached bytecode: a same-size edit within the same second as the cached
    .pyc (whose check is mtime + size) would otherwise import the previous text."""
    path.write_text(text)
    with contextlib.suppress(FileNotFoundError, ValueError):
        os.unlink(importlib.util.cache_from_source(str(path)))


def preload(root: Path) -> None:
    """Import the heavy third-party modules once in this process: each mutant's pytest is forked from it and
    imports only the tree's own packages (``root/src``: meshforge) and the tests, fresh, from its copy. None of those
    may be in this process, or a forked run would test them instead of the mutant."""
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    own = {p.stem for p in (root / "src").glob("*") if p.is_dir() or p.suffix == ".py"}
    leaked = sorted(n for n in sys.modules if n.split(".", 1)[0] in own)
    if leaked:
        raise RuntimeError(f"the runner has imported {leaked[:3]}: a forked run would test them, not the mutant")


def start_pytest(copy: Path, tests: list[str], log: Path, first_failure: bool = True) -> int:
    """Fork a child that runs pytest on ``tests`` in the copy (its own process group, output to ``log``); its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 3
    try:
        os.setpgrp()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        # a capturing parent's sys.stdout (pytest's, in the runner's own test) is not fd 1
        sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(copy)
        os.environ.update(PYTHONPATH=str(copy / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        sys.path.insert(0, str(copy / "src"))
        import pytest

        flags = ["-x"] if first_failure else []
        code = int(pytest.main([*flags, "-q", "-rfE", "-p", "no:randomly", "-p", "no:cacheprovider", *tests]))
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def wait_pytest(pid: int, deadline: float) -> int | None:
    """pytest's exit code, or None when ``deadline`` (time.monotonic) passed (its process group is killed)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


def failed_tests(log: Path) -> list[str]:
    """The node ids pytest's short summary names as FAILED or ERROR."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        for tag in ("FAILED ", "ERROR "):
            if line.startswith(tag):
                out.append(line[len(tag) :].split(" - ", 1)[0].strip())
    return out


@dataclass
class Slot:
    """One temporary copy of the tree and the mutant running in it."""

    copy: Path
    mutant: Mutant | None = None
    pid: int = 0
    original: str = ""
    started: float = 0.0
    tree: dict[str, str] | None = None  # the tree's snapshot: what a restored file must hash to


def plant(slot: Slot, m: Mutant) -> None:
    target = slot.copy / m.file
    slot.mutant, slot.original, slot.started = m, target.read_text(), time.monotonic()
    write_source(target, slot.original.replace(m.find, m.replace, 1))
    log = slot.copy.parent / f"{slot.copy.name}.log"
    slot.pid = start_pytest(slot.copy, list(m.tests), log)


def restore(slot: Slot) -> None:
    """Put the file's original text back and check it by hash (a tree left mutated would poison later runs)."""
    assert slot.mutant is not None
    target = slot.copy / slot.mutant.file
    write_source(target, slot.original)
    want = (slot.tree or {}).get(slot.mutant.file, hashlib.sha256(slot.original.encode()).hexdigest())
    if hashlib.sha256(target.read_bytes()).hexdigest() != want:
        raise RuntimeError(f"{target} was not restored to the tree's text")


def outcome(code: int | None, log: Path) -> str:
    if code is None:
        return "killed (timeout)"
    if code == 1:
        return "killed"
    if code == 0:
        return "SURVIVED"
    return f"error (pytest exit {code}):\n{log.read_text(errors='replace')[-2000:]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--only", default="", help="only the mutants whose name contains one of these (comma-separated)")
    ap.add_argument("--list", action="store_true", help="validate and list the mutants, run nothing")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of the tests on the unmutated tree")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant's test run (default 600)")
    ap.add_argument("--jobs", type=int, default=JOBS, help=f"mutants run at a time, each in its copy (default {JOBS})")
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
    return run(chosen, args.no_baseline, args.timeout, args.jobs)


def run(chosen: list[Mutant], no_baseline: bool, timeout: float, jobs: int = 1, root: Path = REPO) -> int:
    """Every mutant in ``jobs`` temporary copies of the tree, then the baseline of the tests that killed them;
    prints one line each and the survivors. The tree at ``root`` is checked unchanged at the end."""
    start, before = time.perf_counter(), snapshot(root)
    preload(root)
    with tempfile.TemporaryDirectory(prefix="meshforge-mutants-") as tmp:
        slots = [Slot(Path(tmp) / f"copy{i}", tree=before) for i in range(max(1, jobs))]
        for slot in slots:
            copy_tree(root, slot.copy)
        results = run_slots(slots, chosen, timeout)
        unsound = [] if no_baseline else baseline([s.copy for s in slots], results, timeout)
    if snapshot(root) != before:
        print(f"the tree at {root} changed during the run: check `git status` there")
        return 1
    bad = [(m, o) for m, o, _ in results if not o.startswith("killed")]
    bad += [(m, "killed by a test that fails unmutated") for m in unsound]
    killed = len(results) - len(bad)
    print(f"{killed} of {len(results)} mutants killed in {time.perf_counter() - start:.0f} s ({len(slots)} at a time)")
    for m, result in bad:
        print(f"  {result.split(chr(10))[0]}: {m.name} ({m.source}): {m.why}")
    return 1 if bad else 0


def run_slots(slots: list[Slot], chosen: list[Mutant], timeout: float) -> Results:
    """(mutant, outcome, the tests that killed it) for each, ``len(slots)`` running at a time."""
    todo, results = list(chosen), []
    try:
        while todo or any(s.mutant for s in slots):
            step_slots(slots, todo, results, timeout)
            time.sleep(0.05)
    finally:  # Ctrl-C or an error: no forked run outlives the copies
        for slot in slots:
            if slot.mutant is not None:
                wait_pytest(slot.pid, 0)
    return results


Results = list[tuple[Mutant, str, list[str]]]


def step_slots(slots: list[Slot], todo: list[Mutant], results: Results, timeout: float) -> None:
    """Start a mutant in every free slot; collect, restore and print every finished (or late) one."""
    for slot in slots:
        if slot.mutant is None and todo:
            plant(slot, todo.pop(0))
    for slot in slots:
        if slot.mutant is None:
            continue
        done, status = os.waitpid(slot.pid, os.WNOHANG)
        if not done and time.monotonic() - slot.started <= timeout:
            continue
        code = os.waitstatus_to_exitcode(status) if done else wait_pytest(slot.pid, 0)
        m, log, seconds = slot.mutant, slot.copy.parent / f"{slot.copy.name}.log", time.monotonic() - slot.started
        restore(slot)
        slot.mutant = None
        result = outcome(code, log)
        results.append((m, result, failed_tests(log) if code == 1 else list(m.tests)))
        print(f"{result.split(chr(10))[0]:18} {seconds:6.1f} s  {m.name}  ({m.file})", flush=True)
        if result.startswith("error"):
            print(result.split("\n", 1)[1])


def baseline(copies: list[Path], results: Results, timeout: float) -> list[Mutant]:
    """Run every test that killed a mutant on the unmutated copies (a test failing there kills mutants for nothing;
    split over the copies, run at once); the mutants killed only by such tests."""
    killers = sorted({t for _, result, tests in results if result.startswith("killed") for t in tests})
    if not killers:
        return []
    began, failing = time.monotonic(), set()
    groups = [(copy, killers[i :: len(copies)], copy.parent / f"baseline{i}.log") for i, copy in enumerate(copies)]
    runs = [(start_pytest(copy, tests, log, first_failure=False), tests, log) for copy, tests, log in groups if tests]
    try:
        for pid, tests, log in runs:
            code = wait_pytest(pid, began + timeout * 2)
            failing |= set(tests) if code is None else set(failed_tests(log)) if code else set()
            if code not in (0, 1, None):
                print(log.read_text(errors="replace")[-2000:])
                failing |= set(tests)
    finally:  # Ctrl-C: no baseline run outlives the copies
        for pid, _, _ in runs:
            with contextlib.suppress(ChildProcessError):
                wait_pytest(pid, 0)
    print(
        f"baseline: {len(killers)} killing tests on the unmutated tree: {len(failing)} fail "
        f"({time.monotonic() - began:.0f} s)" + "".join(f"\n  fails unmutated: {t}" for t in sorted(failing))
    )
    return [m for m, result, tests in results if result.startswith("killed") and tests and set(tests) <= failing]


if __name__ == "__main__":
    sys.exit(main())
