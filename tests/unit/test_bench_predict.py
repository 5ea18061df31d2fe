"""The planner beside the bench: leave-one-out predictions really leave the run out."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshforge.bench.predict import leave_one_out
from meshforge.plan import calibrate
from meshforge.plan.estimate import estimate
from meshforge.plan.hardware import load_hardware


def bench_record(name: str, dp_shard: int = 1, tp: int = 1, pp: int = 1) -> dict:
    flags = {"compile": False, "float8": False, "ac_mode": "none", "param_dtype": "float32", "microbatch_size": 1}
    return {
        "name": name, "status": "ok", "flavor": "debugmodel", "seq_len": 128, "local_batch_size": 4 // dp_shard,
        "layout": {"dp_replicate": 1, "dp_shard": dp_shard, "tp": tp, "pp": pp, "cp": 1,
                   "schedule": "1F1B" if pp > 1 else None},
        "flags": flags, "threads_per_rank": 1, "peak_memory_gib": 0.4, "tps_per_device": 1.0,
    }  # fmt: skip


def test_a_run_the_fit_never_saw_is_predicted_from_the_others() -> None:
    """Four runs measured on a machine that behaves like the planner with known constants, one of them recorded 2x
    too fast: fitted on the other three, the planner predicts what that run should have done, so its error is
    -50 %. (An in-sample fit would have pulled the prediction toward the bad figure.)"""
    hw = load_hardware("cpu")
    truth = dataclasses.replace(hw, efficiency=dataclasses.replace(hw.efficiency, matmul=hw.efficiency.matmul * 0.5))
    records = [bench_record("fsdp", dp_shard=4), bench_record("tp", tp=4), bench_record("fsdp_tp", 2, 2),
               bench_record("pp", pp=4)]  # fmt: skip
    for r in records:
        r["tps_per_device"] = estimate(calibrate.observation(r, Path("x")).layout, truth).tps_per_device
    records[1]["tps_per_device"] *= 2
    loo = leave_one_out(records, "cpu", workers=2)
    assert loo["runs"]["tp"]["error"] == pytest.approx(-0.5, abs=0.05)
    assert loo["runs"]["tp"]["measured"] == records[1]["tps_per_device"]
    assert loo["runs_scored"] == 4 and loo["median_abs_error"] is not None and loo["hardware"] == "cpu"
