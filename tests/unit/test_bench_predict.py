"""The planner beside the bench: leave-one-out predictions really leave the run out."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshforge.bench import analysis, predict
from meshforge.plan.accuracy import calibrate
from meshforge.plan.hardware import load_hardware
from meshforge.plan.physics.estimate import estimate


def bench_record(name: str, dp_shard: int = 1, tp: int = 1, pp: int = 1) -> dict:
    flags = {"compile": False, "float8": False, "ac_mode": "none", "param_dtype": "float32", "microbatch_size": 1}
    return {
        "name": name, "status": "ok", "flavor": "debugmodel", "seq_len": 128, "local_batch_size": 4 // dp_shard,
        "layout": {"dp_replicate": 1, "dp_shard": dp_shard, "tp": tp, "pp": pp, "cp": 1,
                   "schedule": "1F1B" if pp > 1 else None},
        "flags": flags, "threads_per_rank": 1, "peak_memory_gib": 0.4, "tps_per_device": 1.0,
    }  # fmt: skip


def test_a_run_the_fit_never_saw_is_predicted_from_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four runs measured on a machine that behaves like the planner with known constants, one of them recorded 2x
    too fast: fitted on the other three, the planner predicts what that run should have done, so its error is
    -50 %. (An in-sample fit would have pulled the prediction toward the bad figure.) The predictions are cached
    while the runs do not change."""
    hw = load_hardware("cpu")
    truth = dataclasses.replace(hw, efficiency=dataclasses.replace(hw.efficiency, matmul=hw.efficiency.matmul * 0.5))
    records = [bench_record("fsdp", dp_shard=4), bench_record("tp", tp=4), bench_record("fsdp_tp", 2, 2),
               bench_record("pp", pp=4)]  # fmt: skip
    for r in records:
        r["tps_per_device"] = estimate(calibrate.observation(r, Path("x")).layout, truth).tps_per_device
    records[1]["tps_per_device"] *= 2
    results = {"bench": {"name": "m", "baseline": "fsdp"}, "machine": {"device": "cpu"}, "runs": records}
    cache = tmp_path / "cache" / "prediction.json"
    predict.attach_predictions(results, "cpu", cache=cache)
    loo = results["prediction"]
    assert loo["runs"]["tp"]["error"] == pytest.approx(-0.5, abs=0.05)
    assert records[1]["prediction_error"] == loo["runs"]["tp"]["error"]
    assert records[1]["predicted_tps_per_device"] == pytest.approx(records[1]["tps_per_device"] / 2, rel=0.1)
    assert loo["runs_scored"] == 4 and loo["median_abs_error"] is not None and loo["hardware"] == "cpu"

    def refit(*args: object, **kwargs: object) -> None:
        raise AssertionError("unchanged runs must be read back from the cache, not refitted")

    monkeypatch.setattr(predict, "leave_one_out", refit)
    again = {**results, "runs": [dict(r) for r in records]}
    predict.attach_predictions(again, "cpu", cache=cache)
    assert again["prediction"] == loo
    assert "Median absolute error over 4 runs" in "\n".join(analysis.prediction_lines(again))
    changed = {**results, "runs": [{**records[0], "tps_per_device": 1.0}, *records[1:]]}
    with pytest.raises(AssertionError, match="cache"):
        predict.attach_predictions(changed, "cpu", cache=cache)
