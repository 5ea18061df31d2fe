"""`make test-mutants-sample`: draw N mutants automatically in the modules a change touched, run their unit tests,
print the survivors (the next blind spot, found without a curated list).

The change is ``git diff BASE`` (the working tree against ``--base``, default origin/main where it exists, else
HEAD~1) restricted to ``src/``. Mutation sites come from an operator set over each touched module's AST (OPERATORS:
comparison flips, ``/`` <-> ``*`` and ``+`` <-> ``-``, off-by-one integer constants, a dropped ``.float()`` /
``.detach()`` / ``.clone()``, the first two call arguments swapped, ``not`` removed, ``and`` <-> ``or``, True <->
False), never inside docstrings, annotations or ``if TYPE_CHECKING:``; each mutated module must parse to the
mutated tree. Sites on the changed lines are drawn first (``--seed``: the same change draws the same mutants), then
the rest of the touched modules. A module's tests are the tests/unit files that import it (by AST: ``import a.b``,
``from a import b``, ``from a.b import c``), run without the slow ones (``-m "not slow"``), first failure stops them.

They run first on the unmutated tree (the baseline: a file that fails there is dropped and named; the slowest
module's time sets the per-mutant timeout: 2 x it + 10 s, at most ``--timeout``); N is then cut to what ``--budget``
seconds (counted from the start, the baseline included) allow at ``--jobs`` mutants at a time, and none starts once
the budget is spent (the last ones end within their timeout).
Each mutant runs in a temporary copy of the tree forked from one process that imported torch once (scripts/mutants.py's
machinery); the tree is never touched.

    python scripts/mutants_sample.py                    # 24 mutants of the change against origin/main (or HEAD~1)
    python scripts/mutants_sample.py --base HEAD~3 -n 30
    python scripts/mutants_sample.py --files src/meshforge/plan/physics/levers.py   # these modules, whole
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
N, BUDGET, TIMEOUT, JOBS, MAX_FILES = 24, 450.0, 60.0, 2, 6
"""24 mutants, none started 450 s after the start (baseline included), each <= 60 s; <= 6 test files per module."""

_spec = importlib.util.spec_from_file_location("mutants_runner", Path(__file__).with_name("mutants.py"))
assert _spec is not None and _spec.loader is not None
runner = importlib.util.module_from_spec(_spec)
sys.modules["mutants_runner"] = runner  # dataclasses look their module up
_spec.loader.exec_module(runner)


@dataclass(frozen=True)
class Site:
    """One drawn mutation: the module, its line (1-based), the operator and the line before / after."""

    file: str
    line: int
    operator: str
    before: str
    after: str
    source: str  # the whole mutated module


FLIPS: dict[type, type] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}  # fmt: skip
ARITH: dict[type, type] = {
    ast.Div: ast.Mult,
    ast.Mult: ast.Div,
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.FloorDiv: ast.Div,
}
DROPPED_CALLS = ("float", "double", "detach", "clone", "contiguous")


def _compare(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in FLIPS:
                new = copy.deepcopy(node)
                new.ops[i] = FLIPS[type(op)]()
                yield f"comparison {type(op).__name__} -> {FLIPS[type(op)].__name__}", new


def _arith(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    if isinstance(node, ast.BinOp) and type(node.op) in ARITH:
        new = copy.deepcopy(node)
        new.op = ARITH[type(node.op)]()
        yield f"operator {type(node.op).__name__} -> {ARITH[type(node.op)].__name__}", new


def _constant(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        yield f"constant {node.value} -> {not node.value}", ast.Constant(not node.value)
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        yield f"constant {node.value} -> {node.value + 1}", ast.Constant(node.value + 1)


def _dropped_call(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in DROPPED_CALLS
        and not node.args
        and not node.keywords
    ):
        yield f"dropped .{node.func.attr}()", copy.deepcopy(node.func.value)


def _swapped_args(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    if (
        isinstance(node, ast.Call)
        and len(node.args) >= 2
        and not any(isinstance(a, ast.Starred) for a in node.args[:2])
    ) and ast.dump(node.args[0]) != ast.dump(node.args[1]):
        new = copy.deepcopy(node)
        new.args[0], new.args[1] = new.args[1], new.args[0]
        yield "first two arguments swapped", new


def _removed_not(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "removed not", copy.deepcopy(node.operand)


def _boolop(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    if isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield f"{type(node.op).__name__.lower()} -> {type(new.op).__name__.lower()}", new


Operator = Callable[[ast.AST], Iterator[tuple[str, ast.AST]]]
OPERATORS: dict[str, Operator] = {
    "compare": _compare,
    "arith": _arith,
    "constant": _constant,
    "dropped_call": _dropped_call,
    "swapped_args": _swapped_args,
    "removed_not": _removed_not,
    "boolop": _boolop,
}


def skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: annotations, ``if TYPE_CHECKING:`` blocks, decorators (docstrings and every other
    string: no operator touches a string)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        hidden: list[ast.AST] = []
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            hidden += [a.annotation for a in ast.walk(node.args) if isinstance(a, ast.arg) and a.annotation]
            hidden += [node.returns] if node.returns else []
            hidden += node.decorator_list
        if isinstance(node, ast.AnnAssign):
            hidden.append(node.annotation)
        if isinstance(node, ast.ClassDef):
            hidden += node.decorator_list
        for h in hidden:
            out |= {id(n) for n in ast.walk(h)}
    return out


def _replaced(tree: ast.Module, target: ast.AST, new: ast.AST) -> ast.Module:
    """A copy of ``tree`` with ``target`` (found by identity) replaced by ``new``."""

    class Swap(ast.NodeTransformer):
        def visit(self, node: ast.AST) -> ast.AST:
            return new if node is target else super().visit(node)

    return Swap().visit(copy.deepcopy(tree, {id(target): target}))  # type: ignore[no-any-return]


@dataclass
class Module:
    """A module's text, tree and the candidate mutations of its nodes (spliced only when drawn)."""

    file: str
    text: str
    tree: ast.Module
    candidates: list[tuple[int, ast.AST, ast.AST, str]]  # (line, node, its mutant, label)


def candidates(file: str, text: str, operators: dict[str, Operator] | None = None) -> Module:
    """Every single-line node the operator set can mutate, outside docstrings, annotations and TYPE_CHECKING."""
    tree = ast.parse(text)
    skip, out = skipped_nodes(tree), []
    for node in ast.walk(tree):
        if id(node) in skip or getattr(node, "end_lineno", None) != getattr(node, "lineno", -1):
            continue
        for op in (operators or OPERATORS).values():
            out += [(node.lineno, node, new, label) for label, new in op(node)]  # type: ignore[attr-defined]
    return Module(file, text, tree, out)


def mutations(file: str, text: str, operators: dict[str, Operator] | None = None) -> Iterator[Site]:
    """Every mutation of a module's text the operator set makes, each re-parsed to the mutated tree."""
    module = candidates(file, text, operators)
    sites = (splice(module, node, new, label) for _, node, new, label in module.candidates)
    yield from (site for site in sites if site is not None)


def splice(module: Module, node: ast.AST, new: ast.AST, label: str) -> Site | None:
    """The module with ``node``'s text replaced by ``new``'s (parenthesised if needed), or None when the result does
    not parse to the mutated tree (a splice that changed more than the node)."""
    lines = module.text.splitlines(keepends=True)
    want = ast.dump(_replaced(module.tree, node, new))
    row, start, end = node.lineno - 1, node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
    line = lines[row]
    raw = line.encode()
    for code in (ast.unparse(new), f"({ast.unparse(new)})"):
        mutated_line = (raw[:start] + code.encode() + raw[end:]).decode()
        source = "".join([*lines[:row], mutated_line, *lines[row + 1 :]])
        try:
            if ast.dump(ast.parse(source)) == want:
                return Site(module.file, row + 1, label, line.rstrip("\n"), mutated_line.rstrip("\n"), source)
        except SyntaxError:
            continue
    return None


def default_base(root: Path) -> str:
    """origin/main where the repository has it, else HEAD~1."""
    probe = subprocess.run(["git", "rev-parse", "--verify", "-q", "origin/main"], cwd=root, capture_output=True)
    return "origin/main" if probe.returncode == 0 else "HEAD~1"


def changed_lines(root: Path, base: str, to: str = "") -> dict[str, set[int]]:
    """{module under src/: the line numbers the change added or modified} of ``git diff base [to]`` (without ``to``:
    the working tree; with it, line numbers are ``to``'s, which the working tree is assumed to keep)."""
    diff = subprocess.run(
        ["git", "diff", "-U0", "--no-color", base, *([to] if to else []), "--", "src"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    out: dict[str, set[int]] = {}
    current = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            name = line[4:].removeprefix("b/")
            current = name if name.endswith(".py") and (root / name).is_file() else None
            if current:
                out.setdefault(current, set())
        elif line.startswith("@@") and current:
            match = re.match(r"@@ -\S+ \+(\d+)(?:,(\d+))? @@", line)
            if match:
                first, count = int(match.group(1)), int(match.group(2) or 1)
                out[current] |= set(range(first, first + count))
    return out


def module_name(file: str) -> str:
    """src/meshforge/plan/layout.py -> meshforge.plan.layout (a package's __init__.py -> the package)."""
    parts = Path(file).with_suffix("").parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module a file imports anywhere (``from a import b`` counts a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def tests_of(root: Path, files: list[str], most: int = MAX_FILES) -> dict[str, list[str]]:
    """{module: the tests/unit files that import it}: at most ``most``, those named after the module first, then the
    smallest (a proxy for the fastest)."""
    imports = {str(p.relative_to(root)): imported(p) for p in sorted((root / "tests" / "unit").glob("test_*.py"))}
    out = {}
    for f in files:
        stem = Path(f).stem
        found = [t for t, names in imports.items() if module_name(f) in names]
        found.sort(key=lambda t: (stem not in Path(t).stem, (root / t).stat().st_size, t))
        out[f] = sorted(found[:most])
    return out


def draw(root: Path, changed: dict[str, set[int]], n: int, seed: int) -> list[Site]:
    """Up to ``n`` mutants: sites on the changed lines first (random order, each line once before any twice), then
    the rest of the modules."""
    rng = random.Random(seed)
    modules = [candidates(f, (root / f).read_text()) for f in sorted(changed)]
    pool = [(m, c) for m in modules for c in m.candidates]
    rng.shuffle(pool)
    seen: dict[tuple[str, int], int] = {}
    ranks = []  # (off the change, how many of its line came before): every line once before any line twice
    for module, (line, *_) in pool:
        ranks.append((line not in changed[module.file], seen.get((module.file, line), 0)))
        seen[(module.file, line)] = ranks[-1][1] + 1
    order = sorted(range(len(pool)), key=lambda i: ranks[i])  # stable: still shuffled within a rank
    pool = [pool[i] for i in order]
    out: list[Site] = []
    for module, (_, node, new, label) in pool:
        site = splice(module, node, new, label)
        if site is not None:
            out.append(site)
        if len(out) == n:
            break
    return out


def as_mutant(index: int, site: Site, tests: list[str], text: str) -> runner.Mutant:
    """The runner's mutant: the whole module's text replaced (a line's text need not be unique)."""
    return runner.Mutant(
        name=f"#{index} {site.file}:{site.line}",
        file=site.file,
        find=text,
        replace=site.source,
        tests=("-m", "not slow", *tests),
        why=site.operator,
        source="sample",
    )


def baseline(slots: list[runner.Slot], tests: dict[str, list[str]], timeout: float) -> dict[str, float]:
    """Each module's test files on the unmutated copies, ``len(slots)`` modules at a time: {module: seconds}. A file
    that fails there (or times out, or cannot be collected) is dropped from ``tests``, and named."""
    todo, seconds = [f for f in tests if tests[f]], {}
    while todo:
        batch, todo = todo[: len(slots)], todo[len(slots) :]
        began = time.monotonic()
        runs = []
        for slot, file in zip(slots, batch, strict=False):
            log = slot.copy.parent / f"baseline-{slot.copy.name}.log"
            runs.append((file, log, runner.start_pytest(slot.copy, ["-m", "not slow", *tests[file]], log, False)))
        for file, log, pid in runs:
            code = runner.wait_pytest(pid, began + timeout)
            seconds[file] = time.monotonic() - began
            failing = {t.split("::", 1)[0] for t in runner.failed_tests(log)} if code == 1 else set()
            if code not in (0, 1):  # a timeout, a collection error, only slow tests (5): none of them is usable
                failing = set(tests[file])
            for bad in sorted(failing):
                print(f"baseline: {bad} fails unmutated: not used for {file}")
            tests[file] = [t for t in tests[file] if t not in failing]
    return seconds


def within_budget(sites: list[Site], seconds: dict[str, float], budget: float, jobs: int) -> list[Site]:
    """The first sites whose tests, run in full (a survivor's cost), fit ``budget`` seconds at ``jobs`` at a time."""
    out, spent = [], 0.0
    for site in sites:
        spent += seconds.get(site.file, 0.0) / jobs
        if spent > budget and out:
            break
        out.append(site)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--base", default="", help="git ref the change is diffed against (default origin/main, else HEAD~1)"
    )
    ap.add_argument("--to", default="", help="diff BASE against this ref, not the working tree (a past commit)")
    ap.add_argument("--files", nargs="*", default=[], help="mutate these modules (whole) instead of a change's")
    ap.add_argument("-n", type=int, default=N, help=f"mutants to draw (default {N})")
    ap.add_argument("--seed", type=int, default=0, help="the draw's seed (default 0)")
    ap.add_argument(
        "--budget", type=float, default=BUDGET, help=f"seconds before the last start (default {BUDGET:.0f})"
    )
    ap.add_argument("--timeout", type=float, default=TIMEOUT, help=f"most seconds per mutant (default {TIMEOUT:.0f})")
    ap.add_argument("--max-files", type=int, default=MAX_FILES, help=f"test files per module (default {MAX_FILES})")
    ap.add_argument("--jobs", type=int, default=JOBS, help=f"mutants at a time (default {JOBS})")
    args = ap.parse_args(argv)
    return sample(REPO, args)


def sample(root: Path, args: argparse.Namespace) -> int:
    """Draw, baseline, run; print the survivors. 0: every drawn mutant killed; 1: a survivor (or nothing to run)."""
    start = time.perf_counter()
    base = args.base or default_base(root)
    changed = {f: set() for f in args.files} if args.files else changed_lines(root, base, args.to)
    what = ", ".join(args.files) if args.files else f"git diff {base} {args.to}".strip()
    if not changed:
        print(f"no module under src/ changed ({what}): nothing to mutate")
        return 0
    tests = tests_of(root, sorted(changed), args.max_files)
    for file in sorted(f for f, t in tests.items() if not t):
        print(f"{file}: no tests/unit file imports {module_name(file)}: every mutant of it would survive")
    changed = {f: lines for f, lines in changed.items() if tests[f]}
    before = runner.snapshot(root)
    runner.preload(root)
    with tempfile.TemporaryDirectory(prefix="meshforge-mutants-") as tmp:
        slots = [runner.Slot(Path(tmp) / f"copy{i}", tree=before) for i in range(max(1, args.jobs))]
        for slot in slots:
            runner.copy_tree(root, slot.copy)
        seconds = baseline(slots, tests, args.budget / 3)  # a module whose tests take longer is dropped
        changed = {f: lines for f, lines in changed.items() if tests[f]}
        left = args.budget - (time.perf_counter() - start)
        sites = within_budget(draw(root, changed, args.n, args.seed), seconds, left, len(slots))
        timeout = min(args.timeout, 2 * max((seconds[s.file] for s in sites), default=0.0) + 10)
        print(
            f"{what}: {len(changed)} module(s) with unit tests; {len(sites)} mutants drawn (seed {args.seed}), "
            f"timeout {timeout:.0f} s each; baseline {sum(seconds.values()):.0f} s",
            flush=True,
        )
        texts = {f: (root / f).read_text() for f in changed}
        mutants = [as_mutant(i, s, tests[s.file], texts[s.file]) for i, s in enumerate(sites)]
        results, unrun = run_within(slots, mutants, timeout, time.monotonic() + left)
    return report(sites, results, unrun, time.perf_counter() - start)


def run_within(
    slots: list[runner.Slot], mutants: list[runner.Mutant], timeout: float, deadline: float
) -> tuple[runner.Results, list[runner.Mutant]]:
    """The mutants ``len(slots)`` at a time (scripts/mutants.py's step), none started after ``deadline``
    (time.monotonic); (the results, the mutants left unrun)."""
    todo, results, unrun = list(mutants), [], []
    try:
        while todo or any(s.mutant for s in slots):
            if todo and time.monotonic() > deadline:
                unrun, todo = todo, []
            runner.step_slots(slots, todo, results, timeout)
            time.sleep(0.05)
    finally:  # Ctrl-C or an error: no forked run outlives the copies
        for slot in slots:
            if slot.mutant is not None:
                runner.wait_pytest(slot.pid, 0)
    return results, unrun


def report(sites: list[Site], results: runner.Results, unrun: list[runner.Mutant], seconds: float) -> int:
    """Print the survivors (file:line, the operator, the line before and after) and the tally."""
    by_name = {f"#{i} {s.file}:{s.line}": s for i, s in enumerate(sites)}
    survivors = [by_name[m.name] for m, outcome, _ in results if outcome == "SURVIVED"]
    # a crash (pytest killed by a signal: SIGBUS on a mutated memory map, SIGSEGV) is a detected mutant
    errors = [m for m, outcome, _ in results if outcome.startswith("error") and "exit -" not in outcome]
    print(f"{len(results) - len(survivors) - len(errors)} of {len(results)} mutants killed in {seconds:.0f} s")
    for site in survivors:
        print(f"SURVIVED {site.file}:{site.line}: {site.operator}\n  - {site.before.strip()}\n  + {site.after.strip()}")
    for m in errors:
        print(f"ERROR (the tests could not run) {m.name}: {m.why}")
    if unrun:
        print(f"{len(unrun)} drawn mutants not run: the --budget ran out (a higher --budget or --timeout, fewer -n)")
    return 1 if survivors or errors or not results else 0


if __name__ == "__main__":
    sys.exit(main())
