"""scripts/gpu_check.py cannot run its checks here (no GPU); these prove its plan, its time boxes and its report
work, so the one GPU session it gets is not lost to a crash in the driver."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from meshforge.config.io import load_config

REPO = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


gpu_check = load_script()


def test_every_planned_train_command_is_a_valid_config(tmp_path: Path) -> None:
    checks = gpu_check.plan(tmp_path)
    names = [c.name for c in checks]
    assert len(set(names)) == len(names) and names[0] == "env"
    for needed in ("train_eager", "train_compile_float8", "train_compile_full_ac", "async_tp", "cp_ring"):
        assert needed in names
    for check in checks:
        if check.overrides:
            load_config(None, check.overrides)
    assert sum(c.timeout_s for c in checks) > 0


def test_dry_run_writes_a_report(tmp_path: Path) -> None:
    only = ["env", "nccl_2_ranks_1_gpu", "async_tp", "deterministic_cpu", "cp_ring"]
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", *only]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert sorted(c["name"] for c in data["checks"]) == sorted(only)
    assert {c["status"] for c in data["checks"]} == {"planned"}
    assert "torch" in data["env"] and "date" in data["env"]
    assert "| cp_ring | planned |" in (tmp_path / "results.md").read_text()


def test_checks_are_time_boxed_and_failure_isolated(tmp_path: Path) -> None:
    py = sys.executable
    checks = [
        gpu_check.Check("sleeper", [py, "-c", "import time; print('started', flush=True); time.sleep(60)"], 2),
        gpu_check.Check("crash", [py, "-c", "raise SystemExit('boom')"], 20),
        gpu_check.Check("fine", [py, "-c", "print('RESULT ' + '{\"x\": 1}')"], 20, parse="result_line"),
    ]
    assert gpu_check.run_all(checks, tmp_path, budget_s=100, progress=lambda line: None) == 0
    data = {c["name"]: c for c in json.loads((tmp_path / "results.json").read_text())["checks"]}
    assert data["sleeper"]["status"] == "timeout" and "started" in data["sleeper"]["tail"]
    assert data["crash"]["status"] == "failed" and "boom" in data["crash"]["tail"]
    assert data["fine"]["status"] == "ok" and data["fine"]["details"]["x"] == 1


def test_budget_spent_skips_the_rest(tmp_path: Path) -> None:
    check = gpu_check.Check("late", [sys.executable, "-c", "pass"], 30)
    assert gpu_check.run_check(check, budget_left=3).status == "skipped"


@pytest.mark.parametrize(("b_losses", "repeatable"), [([2.0, 1.5], True), ([2.0, 1.5000001], False)])
def test_verdict_compares_cuda_runs_and_the_cpu(b_losses: list[float], repeatable: bool) -> None:
    outcome = gpu_check.Outcome
    outcomes = {
        "deterministic_cuda_a": outcome("deterministic_cuda_a", "ok", 1.0, {"losses": [2.0, 1.5]}),
        "deterministic_cuda_b": outcome("deterministic_cuda_b", "ok", 1.0, {"losses": b_losses}),
        "deterministic_cpu": outcome("deterministic_cpu", "ok", 1.0, {"losses": [2.0, 1.50001]}),
        "train_compile": outcome("train_compile", "ok", 1.0, {"mfu_pct": 41.0}),
    }
    verdict = gpu_check.judge(outcomes)
    assert verdict["cuda_bitwise_repeatable"] is repeatable
    assert verdict["cuda_matches_cpu_1e-4"] and verdict["train_compile_mfu_vs_torchtitan_39"] == 2.0
