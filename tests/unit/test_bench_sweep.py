"""The sweep loop with the sequential rule (cli.sweep), its jobs replaced by synthetic repetitions: a steady run
stops at the minimum, a noisy one goes on to the maximum, an oversubscribed one runs once, and the time budget ends
the extra rounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshforge.bench import cli
from meshforge.bench.matrix import parse_matrix
from meshforge.bench.runner import Launch, plan_sweep
from meshforge.bench.spec import BenchMatrix, BenchRun


def matrix_with(budget: float) -> BenchMatrix:
    tree = {
        "bench": {"name": "m", "flavor": "tiny", "seq_len": 64, "global_batch_size": 4, "warmup_steps": 1,
                  "measured_steps": 4, "repeat": 3, "max_repeat": 6, "target_half_width": 0.05, "cores": 2,
                  "ranked_ranks": 2, "oversubscribed_repeat": 1, "time_budget_s": budget},
        "run": [{"name": "steady", "ranks": 0}, {"name": "noisy", "ranks": 0}, {"name": "crowded", "ranks": 4}],
    }  # fmt: skip
    return parse_matrix(tree, device="cpu")


def fake_sweep(matrix: BenchMatrix, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    order: list[str] = []

    def run_one(matrix: BenchMatrix, run: BenchRun, out: Path, launch: Launch, **kw: Any) -> dict[str, Any]:
        order.append(run.name)
        spread = 0.5 if run.name == "noisy" else 0.001  # a process shift of +-50 %: never narrow
        level = 100 * (1 + spread * rng.standard_normal())
        metrics = [{"step": s, "tps": level, "loss": 8.0, "peak_memory_gib": 0.1, "elapsed_s": s} for s in range(1, 6)]
        return {"index": kw["index"], "status": "ok", "error": "", "metrics": metrics, "wall_s": 5.0,
                "startup_s": 0.5, "command": ["x"]}  # fmt: skip

    monkeypatch.setattr(cli, "run_one", run_one)
    monkeypatch.setattr(cli, "speed_probe", lambda: 1.0)
    monkeypatch.setattr(cli, "machine_info", lambda: {"device": "cpu", "cpu_cores": 2})
    plan = plan_sweep(matrix, tmp_path)
    results = cli.sweep(matrix, plan, tmp_path, Launch(warm=False))
    results["order"] = order
    return results


def test_rule_stops_the_steady_run_and_spends_on_the_noisy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = fake_sweep(matrix_with(budget=0), tmp_path, monkeypatch)
    reps = {r["name"]: len(r["repetitions"]) for r in results["runs"]}
    assert reps == {"steady": 3, "noisy": 6, "crowded": 1}
    assert results["order"][:3] == ["steady", "noisy", "crowded"] and results["order"][-3:] == ["noisy"] * 3
    assert results["sweep"]["stopping"]["maximum"] == 6 and results["runs"][2]["oversubscribed"] is True


def test_time_budget_ends_the_extra_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = fake_sweep(matrix_with(budget=1e-6), tmp_path, monkeypatch)  # spent before the first extra round
    assert {r["name"]: len(r["repetitions"]) for r in results["runs"]} == {"steady": 3, "noisy": 3, "crowded": 1}


def test_a_failing_planner_does_not_lose_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshforge.bench import analysis, predict

    def broken(*args: Any, **kw: Any) -> None:
        raise AttributeError("'Layout' object has no attribute 'gradient_sync'")

    monkeypatch.setattr(predict, "attach_predictions", broken)
    results: dict[str, Any] = {"runs": []}
    cli.predict(results, "cpu", tmp_path)
    assert results["prediction"]["error"].startswith("AttributeError: 'Layout'")
    assert "predictions failed (AttributeError" in capsys.readouterr().err
    assert "fits failed (AttributeError" in analysis.prediction_lines(results)[0]


def test_no_warm_launcher_for_a_sweep_whose_runs_would_not_use_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused layout starts nothing and a fault-tolerant row its own groups: the warm launcher (seconds of imports
    before the first run) is not started for them; a run that starts from it still gets it."""
    head = {
        "name": "m",
        "flavor": "tiny",
        "seq_len": 64,
        "global_batch_size": 4,
        "warmup_steps": 1,
        "measured_steps": 1,
    }
    runs = [
        {"name": "tp_bad", "ranks": 4, "tp": 4},
        {"name": "ft", "ranks": 4, "dp_replicate": 2, "fault_tolerance": True},
    ]
    matrix = parse_matrix({"bench": head, "run": [*runs, {"name": "fsdp", "ranks": 2}]}, device="cpu")
    started: list[object] = []
    monkeypatch.setattr(cli, "WarmLauncher", lambda env: started.append(env) or type("W", (), {"usable": True})())
    assert cli.start_warm(matrix, tmp_path, Launch(), matrix.runs[:2]) is None and not started
    assert cli.start_warm(matrix, tmp_path, Launch(), matrix.runs) is not None and len(started) == 1
