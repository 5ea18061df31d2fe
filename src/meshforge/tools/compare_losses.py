"""`meshforge compare-losses RUN_A RUN_B [--assert-equal | --rtol X]`: two runs' losses, step by step.

Reads each run's ``metrics.jsonl`` (a run folder or the file itself), prints a table of the steps both runs logged with
the absolute and relative differences, draws both curves into a PNG, and with ``--assert-equal`` (bitwise: the JSON
floats round-trip exactly) or ``--rtol X`` (|a - b| <= X |b|) exits 1 when they differ. A step that only one run logged
counts as a difference when asserting. This is how a change that must not move numerics proves it: run the same config
before and after, then compare with ``--assert-equal`` (deterministic runs) or a stated ``--rtol``.

Exit codes: 0 equal (or nothing asserted), 1 different, 2 unreadable input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path


class InputError(Exception):
    """A run that cannot be read: missing file, bad JSON, no records with the key."""


@dataclass(frozen=True)
class Row:
    step: int
    a: float | None  # None: this run did not log the step
    b: float | None

    @property
    def abs_diff(self) -> float | None:
        return None if self.a is None or self.b is None else abs(self.a - self.b)

    @property
    def rel_diff(self) -> float | None:
        diff = self.abs_diff
        if diff is None or self.b is None:
            return None
        return diff / abs(self.b) if self.b != 0 else (0.0 if diff == 0 else math.inf)


def metrics_path(run: str) -> Path:
    path = Path(run)
    return path / "metrics.jsonl" if path.is_dir() else path


def read_series(run: str, key: str) -> dict[int, float]:
    """step -> value of ``key`` from a run's metrics.jsonl (the last record wins if a step repeats, as after a
    resume)."""
    path = metrics_path(run)
    if not path.is_file():
        raise InputError(f"{run}: no metrics.jsonl there (give a run's dump_folder or the file)")
    series: dict[int, float] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if key in record and record[key] is not None:
            series[int(record["step"])] = float(record[key])
    if not series:
        raise InputError(f"{path}: no record has a {key!r} value")
    return series


def align(a: dict[int, float], b: dict[int, float]) -> list[Row]:
    return [Row(step, a.get(step), b.get(step)) for step in sorted(a.keys() | b.keys())]


def same(x: float, y: float, rtol: float | None) -> bool:
    """Bitwise when ``rtol`` is None; NaN equals NaN (two runs that diverge identically are identical)."""
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return x == y if rtol is None else abs(x - y) <= rtol * abs(y)


def differences(rows: list[Row], rtol: float | None) -> list[str]:
    """One line per step that breaks the assertion."""
    out = []
    for row in rows:
        if row.a is None or row.b is None:
            out.append(f"step {row.step}: only run {'B' if row.a is None else 'A'} logged it")
        elif not same(row.a, row.b, rtol):
            out.append(f"step {row.step}: {row.a!r} vs {row.b!r} (rel diff {row.rel_diff:.3e})")
    return out


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[Row], key: str) -> str:
    lines = [f"{'step':>7}  {key + ' A':>14}  {key + ' B':>14}  {'abs diff':>10}  {'rel diff':>10}"]
    for r in rows:
        lines.append(
            f"{r.step:>7}  {_cell(r.a, '14.8f')}  {_cell(r.b, '14.8f')}  "
            f"{_cell(r.abs_diff, '10.3e')}  {_cell(r.rel_diff, '10.3e')}"
        )
    both = [r for r in rows if r.abs_diff is not None]
    if both:
        worst = max(both, key=lambda r: r.abs_diff or 0.0)
        worst_diff = f"max abs diff {worst.abs_diff:.3e} (rel {worst.rel_diff:.3e}) at step {worst.step}"
        lines.append(f"{len(both)} common steps; {worst_diff}")
    return "\n".join(lines)


def plot(a: dict[int, float], b: dict[int, float], labels: tuple[str, str], key: str, path: Path) -> None:
    """Both curves on one axis, the second dashed so identical curves stay visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(list(a), list(a.values()), label=f"A: {labels[0]}", linewidth=2)
    ax.plot(list(b), list(b.values()), label=f"B: {labels[1]}", linestyle="--", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(f"{key}: A vs B")
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="meshforge compare-losses", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_a", metavar="RUN_A", help="a run's dump_folder or its metrics.jsonl")
    parser.add_argument("run_b", metavar="RUN_B", help="the run to compare with (the reference for --rtol)")
    check = parser.add_mutually_exclusive_group()
    check.add_argument("--assert-equal", action="store_true", help="exit 1 unless every step is bitwise equal")
    check.add_argument("--rtol", type=float, default=None, help="exit 1 unless |a - b| <= RTOL x |b| at every step")
    parser.add_argument("--key", default="loss", help="the metric to compare (default: loss)")
    parser.add_argument(
        "--plot",
        default="outputs/compare_losses.png",
        help="where to write the PNG ('' for none; default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.rtol is not None and not args.rtol >= 0:
        parser.error(f"--rtol {args.rtol} must be >= 0")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        a, b = read_series(args.run_a, args.key), read_series(args.run_b, args.key)
    except InputError as exc:
        print(f"meshforge compare-losses: error: {exc}", file=sys.stderr)
        return 2
    rows = align(a, b)
    print(f"A: {metrics_path(args.run_a)}\nB: {metrics_path(args.run_b)}")
    print(format_table(rows, args.key))
    if args.plot:
        plot(a, b, (args.run_a, args.run_b), args.key, Path(args.plot))
        print(f"plot: {args.plot}")
    if not (args.assert_equal or args.rtol is not None):
        return 0
    wanted = "bitwise equal" if args.assert_equal else f"equal within rtol {args.rtol:g}"
    bad = differences(rows, None if args.assert_equal else args.rtol)
    if bad:
        print(f"FAIL: {len(bad)} of {len(rows)} steps are not {wanted}:", *bad[:20], sep="\n  ")
        return 1
    print(f"OK: all {len(rows)} steps are {wanted}")
    return 0
