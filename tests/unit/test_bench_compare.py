"""`meshforge bench compare` on two synthetic results files: a real regression is flagged, noise is not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshforge.bench import compare
from meshforge.config.io import ConfigError


def record(name: str, median: float, noise: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    steps = [[round(float(v), 2) for v in median * (1 + noise * rng.standard_normal(4))] for _ in range(3)]
    return {"name": name, "status": "ok", "tps_per_device": float(np.median(steps)), "tps_steps": steps}


def noisy(scale: float) -> dict:
    steps = [[80.0, 120.0, 95.0, 105.0], [115.0, 85.0, 100.0, 130.0], [90.0, 100.0, 120.0, 70.0]]
    steps = [[v * scale for v in rep] for rep in (steps if scale == 1 else steps[::-1])]
    return {"name": "noisy", "status": "ok", "tps_per_device": float(np.median(steps)), "tps_steps": steps}


def write(path: Path, records: list[dict]) -> str:
    path.write_text(json.dumps({"schema_version": 2, "runs": records}))
    return str(path)


@pytest.fixture
def sweeps(tmp_path: Path) -> tuple[str, str]:
    old = [
        record("steady", 100, 0.02, 1),  # same speed, new noise
        record("regressed", 100, 0.02, 2),  # 20 % slower: a real regression
        noisy(1.0),  # 8 % slower, but the noise is wider than that
        record("slightly", 100, 0.005, 4),  # 3 % slower beyond noise: within a 5 % threshold
        record("faster", 100, 0.02, 5),
        record("gone", 100, 0.02, 6),
    ]
    new = [
        record("steady", 100, 0.02, 11),
        record("regressed", 80, 0.02, 12),
        noisy(0.92),
        record("slightly", 97, 0.005, 14),
        record("faster", 130, 0.02, 15),
        {"name": "broken", "status": "failed", "tps_per_device": None},
    ]
    return write(tmp_path / "old.json", old), write(tmp_path / "new.json", new)


def test_only_the_real_regression_fails(sweeps: tuple[str, str]) -> None:
    rows = {c.name: c for c in compare.changes(compare.read(sweeps[0]), compare.read(sweeps[1]), 0.05, 0.95)}
    assert set(rows) == {"steady", "regressed", "noisy", "slightly", "faster"}
    assert rows["regressed"].regression and rows["regressed"].beyond_noise
    assert rows["regressed"].change == pytest.approx(-0.2, abs=0.03)
    assert not rows["steady"].beyond_noise and not rows["steady"].regression
    assert rows["noisy"].change < -0.05 and not rows["noisy"].beyond_noise and not rows["noisy"].regression
    assert rows["slightly"].beyond_noise and not rows["slightly"].regression
    assert rows["slightly"].verdict() == "slower (within threshold)"
    assert rows["faster"].verdict() == "faster"
    tight = compare.changes(compare.read(sweeps[0]), compare.read(sweeps[1]), 0.01, 0.95)
    assert {c.name for c in tight if c.regression} == {"regressed", "slightly"}


def test_exit_status_gates_ci(sweeps: tuple[str, str]) -> None:
    cmd = [sys.executable, "-m", "meshforge", "bench", "compare", *sweeps]
    proc = subprocess.run([*cmd, "--fail-above", "5%"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "1 regression(s): regressed" in proc.stdout and "only in the old sweep: gone" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if "`regressed`" in line)
    assert "**REGRESSION**" in row and "| -" in row  # the change column shows the slowdown
    proc = subprocess.run([*cmd, "--fail-above", "25%", "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and json.loads(proc.stdout)["regressions"] == []


def test_old_files_without_step_values_are_judged_on_the_threshold(tmp_path: Path) -> None:
    old = write(tmp_path / "a.json", [{"name": "x", "status": "ok", "tps_per_device": 100.0}])
    new = write(tmp_path / "b.json", [{"name": "x", "status": "ok", "tps_per_device": 90.0}])
    (row,) = compare.changes(compare.read(old), compare.read(new), 0.05, 0.95)
    assert row.ratio is None and row.regression and row.verdict() == "**REGRESSION**"


@pytest.mark.parametrize(("text", "value"), [("5%", 0.05), ("12.5", 0.125), ("0%", 0.0)])
def test_threshold_parses(text: str, value: float) -> None:
    assert compare.parse_threshold(text) == pytest.approx(value)


def test_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--fail-above 'five'"):
        compare.parse_threshold("five")
    with pytest.raises(ConfigError, match="does not exist"):
        compare.read(str(tmp_path / "missing.json"))
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"not a results\.json"):
        compare.read(str(tmp_path / "x.json"))


def test_agreement_of_two_sweeps(sweeps: tuple[str, str]) -> None:
    """The 'Done means' check: medians within 10 % and no separable pair ordered differently."""
    old, new = compare.read(sweeps[0]), compare.read(sweeps[1])
    (line,) = compare.agreement(old, new, 0.10, 0.95)
    assert "DO NOT agree" in line and "beyond: regressed, faster" in line
    same = {n: r for n, r in old.items() if n in ("steady", "slightly")}
    assert "sweeps agree" in compare.agreement(same, {n: new[n] for n in same}, 0.10, 0.95)[0]
    a_fast, b = record("a", 200, 0.01, 21), record("b", 100, 0.01, 22)
    assert compare.order_flips({"a": a_fast, "b": b}, {"a": record("a", 190, 0.01, 23), "b": b}, 0.95) == []
    flipped = {"a": record("a", 90, 0.01, 24), "b": b}
    assert compare.order_flips({"a": a_fast, "b": b}, flipped, 0.95) == ["a|b"]
    assert "DO NOT agree" in compare.agreement({"a": a_fast, "b": b}, flipped, 0.99, 0.95)[0]  # order alone fails
    # a run with more ranks than cores: its speed is the scheduler's; named apart, not in the verdict
    crowded = {"c": record("c", 100, 0.01, 25) | {"oversubscribed": True}}
    moved = {"c": record("c", 70, 0.01, 26) | {"oversubscribed": True}}
    verdict, aside = compare.agreement({**same, **crowded}, {**{n: new[n] for n in same}, **moved}, 0.10, 0.95)
    narrow = {n: r | {"tps_per_device_ci_half_width": 0.04} for n, r in same.items()}
    wide = {**narrow, "slightly": narrow["slightly"] | {"tps_per_device_ci_half_width": 0.06}, **crowded}
    assert (
        compare.precision_line(narrow, wide)
        == "Intervals within +-5% (runs with a core per rank): old 2 of 2, new 1 of 2"
    )
    assert "sweeps agree" in verdict and "2 of 2 runs" in verdict and ": c -29.7%" in aside  # seeded records


def test_a_machine_that_slowed_down_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every run 9 % slower because the host was (its probe says 9 %): the raw verdict stands, the speed line and
    the divided-out agreement say why."""
    names = ["a", "b", "c"]
    old = [record(n, 100 * (i + 1), 0.01, i) for i, n in enumerate(names)]
    new = [record(n, 88 * (i + 1), 0.01, 10 + i) for i, n in enumerate(names)]
    speeds = ({"median": 40.0, "gflops": [40.0]}, {"median": 36.4, "gflops": [36.4]})
    paths = []
    for label, records, speed in (("old", old, speeds[0]), ("new", new, speeds[1])):
        data = {"schema_version": 2, "runs": records, "sweep": {"machine_speed": speed}}
        (tmp_path / f"{label}.json").write_text(json.dumps(data))
        paths.append(str(tmp_path / f"{label}.json"))
    compare.main([*paths, "--fail-above", "20%"])
    out = capsys.readouterr().out
    assert "Agreement: the sweeps DO NOT agree" in out
    assert "40.0 -> 36.4 GFLOP/s (-9.0%)" in out
    assert "With the machine's change divided out: the sweeps agree" in out


def test_the_sweep_flags_its_own_speed_drift() -> None:
    from meshforge.bench.machine import noise_warnings, speed_summary

    steady, drifted = speed_summary([40.0, 40.4, 39.8, 40.1]), speed_summary([40.0, 40.2, 36.0, 35.5])
    assert steady["spread"] < 0.02 and drifted["spread"] == pytest.approx(4.7 / 38, abs=1e-3)
    machine = {"cpu_cores": 2, "load_avg_1m_before": 0.1}
    assert noise_warnings(machine, {"machine_speed": steady}, []) == []
    (warning,) = noise_warnings(machine, {"machine_speed": drifted}, [])
    assert "speed moved by 12%" in warning and "35.5-40.2 GFLOP/s" in warning
