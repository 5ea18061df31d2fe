"""scripts/local_ranks_check.py (issue 46 item 1 on one GPU) cannot run its CUDA runs here: its plan, boxes and
verdicts are checked instead; its runs are tests/distributed/test_local_ranks.py's layouts, parity-tested on CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("local_ranks_check", REPO / "scripts" / "local_ranks_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["local_ranks_check"] = module
    spec.loader.exec_module(module)
    return module


check = load_script()


def test_the_plan_fits_its_budget_and_every_config_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and out.count("--local-ranks") == 5
    assert set(check.BOX_S) == set(check.RUNS) and sum(check.BOX_S.values()) <= check.BUDGET_S
    for name, (shape, ranks, _) in check.RUNS.items():  # every reference runs before the runs it serves
        assert ranks == 0 or list(check.RUNS).index(check.REFERENCE[shape]) < list(check.RUNS).index(name)


def test_a_run_off_its_reference_is_wrong_and_one_without_a_reference_unchecked() -> None:
    ref = {"name": "dense_ref", "status": "ok", "loss": [8.0, 7.9], "grad_norm": [0.7, 0.8]}
    close = {"name": "local_tp2", "status": "ok", "loss": [8.0000001, 7.9], "grad_norm": [0.7, 0.8]}
    assert check.judge(close, ref)["status"] == "ok"
    assert check.judge({**close, "loss": [8.0, 7.9002]}, ref)["status"] == "wrong"  # 2.5e-5 > 1e-5
    assert check.judge({**close, "grad_norm": [0.7, 0.80001]}, ref)["status"] == "wrong"  # 1.2e-5 > 1e-6
    assert check.judge(close, {**ref, "status": "failed"})["status"] == "unchecked"
    assert check.judge(close, None)["status"] == "unchecked"
