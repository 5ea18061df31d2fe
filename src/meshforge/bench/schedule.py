"""Which run gets another repetition: the bench's sequential stopping rule.

Every run gets ``repeat`` repetitions (the minimum: 3 by default; a run with more ranks than cores gets
``oversubscribed_repeat``), interleaved across runs. Past the minimum, a run is repeated again, one repetition per
round (strategies before other groups, each widest interval first), while its interval is wider than
+-``target_half_width`` (5 %), it has fewer than ``max_repeat`` repetitions and the sweep's time so far plus that
run's repetition (the median of its earlier ones) fits in ``time_budget_s``. A run that already knows its figure
stops; a noisy one gets the time.

Stopping when an interval is narrow enough selects samples whose spread happened to look small, so the stopped
interval covers somewhat less often than a fixed-size one. tests/unit/test_bench_schedule.py simulates the rule as
configured here (minimum 3, target +-5 %, up to 10 repetitions, between-repetition noise 1-8 %, 2000 sweeps each)
and requires coverage >= 95 % - 5 points (``COVERAGE_MARGIN``); docs/bench.md gives the measured figures.
"""

from __future__ import annotations

import statistics
from typing import Any

from meshforge.bench.spec import BenchMatrix, BenchRun

COVERAGE_MARGIN = 0.05
"""How far below the nominal level the sequential rule's coverage may fall (simulated; see the module docstring)."""


def minimum_repeat(matrix: BenchMatrix, run: BenchRun) -> int:
    """Repetitions every run gets whatever its interval: ``repeat``, or ``oversubscribed_repeat`` for a run with more
    ranks than cores (it is not ranked on speed)."""
    if matrix.oversubscribed(run) and matrix.oversubscribed_repeat:
        return min(matrix.oversubscribed_repeat, matrix.repeat)
    return matrix.repeat


def wants_another(
    matrix: BenchMatrix, run: BenchRun, reps: list[dict[str, Any]], record: dict[str, Any] | None
) -> bool:
    """Does ``run`` (with these repetitions so far and its current record) get another repetition?"""
    done = len(reps)
    if done and reps[0]["status"] != "ok":
        return False  # refused or failed at once: repeating it says nothing new
    if done < minimum_repeat(matrix, run):
        return True
    if matrix.oversubscribed(run) or done >= matrix.max_repeat:
        return False
    half = (record or {}).get("tps_per_device_ci_half_width")
    return half is None or half > matrix.target_half_width


def fits(matrix: BenchMatrix, run: BenchRun, reps: list[dict[str, Any]], elapsed_s: float) -> bool:
    """May a repetition of ``run`` start now? Always within the minimum; past it, only within the time budget."""
    if len(reps) < minimum_repeat(matrix, run) or not matrix.time_budget_s:
        return True
    walls = [r["wall_s"] for r in reps if r.get("wall_s")]
    return elapsed_s + (statistics.median(walls) if walls else 0.0) <= matrix.time_budget_s


def next_round(
    matrix: BenchMatrix,
    runs: list[BenchRun],
    reps: dict[str, list[dict[str, Any]]],
    records: dict[str, dict[str, Any]],
) -> list[BenchRun]:
    """The runs of the next round, in matrix order while any is within its minimum, else the ranked strategies
    first (group "strategy"), each group widest interval first."""
    wanted = [run for run in runs if wants_another(matrix, run, reps[run.name], records.get(run.name))]
    if any(len(reps[run.name]) < minimum_repeat(matrix, run) for run in wanted):
        return wanted

    def width(run: BenchRun) -> float:
        return float(records.get(run.name, {}).get("tps_per_device_ci_half_width") or 0.0)

    return sorted(wanted, key=lambda run: (run.group != "strategy", -width(run)))


def rule(matrix: BenchMatrix) -> dict[str, Any]:
    """The stopping rule of a sweep as results.json records it."""
    return {
        "minimum": matrix.repeat,
        "maximum": max(matrix.max_repeat, matrix.repeat),
        "target_half_width": matrix.target_half_width if matrix.max_repeat > matrix.repeat else None,
        "time_budget_s": matrix.time_budget_s or None,
        "oversubscribed_repeat": matrix.oversubscribed_repeat or matrix.repeat,
        "ranked_ranks": matrix.ranked_ranks,
        "cores": matrix.cores,
    }
