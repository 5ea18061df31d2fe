"""The memory fit of a one-node CPU calibration predicts runs it did not see (committed bench results, no processes).

docs/benchmarks/planner-one-node/: the bench default's 1- and 2-rank runs (calibrated on) and its 4- and 8-rank runs
(held out). A CPU run's memory figure is a process's peak resident set, ~0.4 GiB of interpreter and libraries beside
0.03-0.11 GiB of tensors: the runs identify that fixed base, not a proportional slack beside it (memory_fit.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshforge.cli import main
from meshforge.plan.accuracy import calibrate, memory_fit
from meshforge.plan.accuracy.fit import allocated_gib
from meshforge.plan.hardware import CPU_EFFICIENCY, HardwareProfile, save_profile
from tests.unit.test_plan_calibrate import SPEC

RUNS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "planner-one-node"
HELD_OUT_BOUND = 0.15
"""|error| bound on the held-out 4- and 8-rank runs' peaks (measured: +1.4 % and +8.8 %)."""
LOO_BOUND = 0.25
"""|error| bound on each calibration run predicted by the fit to the other eight (measured: at most 18.3 %)."""
HW = HardwareProfile(SPEC, CPU_EFFICIENCY)  # memory does not depend on the CPU probe's figures


def _pairs(name: str) -> list[tuple[float, float]]:
    obs = calibrate.read_results(RUNS / name)
    return [(allocated_gib(o, HW), o.peak_memory_gib) for o in obs if o.peak_memory_gib]


def test_one_node_memory_fit_predicts_the_held_out_runs() -> None:
    """Fit on the 1- and 2-rank runs, predict the 4- and 8-rank runs; the slack is held and the output says why."""
    fitted = memory_fit.fit_memory_terms(_pairs("calibrate-1-2-ranks.json"), HW)
    held = calibrate.read_results(RUNS / "held-out-4-8-ranks.json")
    assert sorted(o.layout.world_size for o in held) == [4, 8]
    errors = {row["name"]: row["memory_error"] for row in calibrate.compare(held, fitted.apply(HW))}
    assert max(abs(e) for e in errors.values()) <= HELD_OUT_BOUND, errors
    assert fitted.allocator_overhead == CPU_EFFICIENCY.allocator_overhead  # not identified: the hardware's
    assert "allocator_overhead held at the hardware's" in fitted.merged
    assert 0.3 < fitted.framework_gib < 0.5  # a process's interpreter and libraries


def test_one_node_memory_fit_leave_one_out() -> None:
    """Each calibration run predicted by the whole procedure (choice of constants included) fitted to the others;
    the profile's memory spread is their RMS log error, not the in-sample residual."""
    pairs = _pairs("calibrate-1-2-ranks.json")
    errors = memory_fit.held_out_errors(pairs, HW)
    assert len(errors) == 9 and max(abs(e) for e in errors) <= LOO_BOUND, errors
    assert memory_fit.fit_memory_terms(pairs, HW).residual_sd == pytest.approx(memory_fit.spread(pairs, HW))


def test_both_constants_fitted_where_the_runs_identify_them() -> None:
    """Allocated sizes spread over 10x, peaks from a known slack and base: both recovered, nothing held."""
    truth = memory_fit.Terms(0.3, 0.4)
    pairs = [(a, truth.predict(a) * (1 + 0.01 * (-1) ** i)) for i, a in enumerate((0.1, 0.3, 0.6, 1.0, 2.0))]
    fitted = memory_fit.fit_memory_terms(pairs, HW)
    assert fitted.merged == ""
    assert fitted.allocator_overhead == pytest.approx(0.3, abs=0.05)
    assert fitted.framework_gib == pytest.approx(0.4, abs=0.03)


def test_calibrate_cli_prints_the_memory_leave_one_out(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--calibrate says which memory constant is held and why, and reports the leave-one-out error."""
    hw_file = tmp_path / "cpu.toml"
    save_profile(HW, hw_file)
    argv = ["plan", "--calibrate", str(RUNS / "calibrate-1-2-ranks.json"), "--hardware", str(hw_file)]
    assert main([*argv, "--out", str(tmp_path / "s.toml")]) == 0
    text = capsys.readouterr().out
    assert "memory: allocator_overhead held at the hardware's 0" in text
    assert "memory, each run predicted by the fit to the others (leave-one-out)" in text
