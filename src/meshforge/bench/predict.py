"""The planner beside every measured run: leave-one-out predictions of tokens/s per device.

For each successful run, this machine's hardware profile (``--hardware``, by default the planner's ``cpu`` preset) is
calibrated on the *other* runs of the same sweep (`meshforge plan --calibrate`'s fit, unchanged) and the fitted
planner predicts the run it has not seen. The error column therefore shows how well the planner predicts a new
layout on this machine, not how well it fits the data it was tuned on. The fits are independent: they run in
parallel, one process per core.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

from meshforge.bench.machine import cpu_cores
from meshforge.plan.accuracy import calibrate, folds, stack
from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.physics.estimate import estimate

PREDICT_SOURCES = (
    "plan/accuracy/calibrate.py",
    "plan/accuracy/memory_fit.py",
    "plan/accuracy/stack.py",
    "plan/shipped.py",
    "bench/predict.py",
    "device/peak.py",
)
"""Besides plan/accuracy/folds.PREDICTION_SOURCES (every module on the planner's prediction path), what these
predictions run: the calibration, the profile reader (a preset, a shipped stack or a stack file), the shipped GPU
constants (a GPU preset's start), this file, and the CPU probe behind the ``cpu`` preset's peaks."""
MIN_TRAINING_RUNS = 2
"""Fewer other runs than this and the fit is not attempted (a run's prediction is then left empty)."""


def fit_profile(observations: list[calibrate.Observation], hw: HardwareProfile) -> HardwareProfile:
    """The planner's calibration, called through one function so a new fitting method drops in unchanged."""
    return calibrate.fit(observations, hw, spread=False)


def observations(records: list[dict[str, Any]]) -> list[calibrate.Observation]:
    """The successful records as the planner's observations (its own reader of bench records)."""
    ok = [r for r in records if r.get("status") == "ok" and r.get("tps_per_device")]
    return [calibrate.observation(r, Path("results.json")) for r in ok]


def _predict_left_out(args: tuple[list[calibrate.Observation], int, HardwareProfile]) -> float | None:
    obs, index, hw = args
    train = [o for i, o in enumerate(obs) if i != index and not o.emulated]
    if len(train) < MIN_TRAINING_RUNS:
        return None
    return estimate(obs[index].layout, fit_profile(train, hw)).tps_per_device


def leave_one_out(records: list[dict[str, Any]], hardware: str = "cpu", workers: int = 0) -> dict[str, Any]:
    """{"hardware", "runs": {name: {predicted, measured, error, emulated}}, "median_abs_error", "runs_scored"}.

    ``error`` is predicted / measured - 1. Emulated Float8 runs are predicted as Float8 but neither fitted nor scored
    (their time is not Float8's)."""
    hw = stack.load_profile(hardware)  # a preset, a shipped stack or a profile file
    obs = observations(records)
    jobs = [(obs, i, hw) for i in range(len(obs))]
    workers = workers or max(1, min(cpu_cores(), len(jobs)))
    if workers > 1:
        context = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            predicted = list(pool.map(_predict_left_out, jobs))
    else:
        predicted = [_predict_left_out(job) for job in jobs]
    runs: dict[str, dict[str, Any]] = {}
    for o, value in zip(obs, predicted, strict=True):
        error = None if value is None else value / o.tps_per_device - 1
        runs[o.name] = {"predicted": value, "measured": o.tps_per_device, "error": error, "emulated": o.emulated}
    scored = [abs(r["error"]) for r in runs.values() if r["error"] is not None and not r["emulated"]]
    return {
        "hardware": hw.name,
        "method": "leave-one-out: calibrated on the other runs of this sweep, then predicted",
        "runs": runs,
        "runs_scored": len(scored),
        "median_abs_error": statistics.median(scored) if scored else None,
    }


def cache_key(records: list[dict[str, Any]], hardware: str) -> str:
    """Changes with anything the predictions depend on: the runs' setups and figures, the profile, the fitting code."""
    keys = ("name", "status", "layout", "flags", "flavor", "seq_len", "local_batch_size", "tps_per_device",
            "peak_memory_gib", "threads_per_rank")  # fmt: skip
    text = json.dumps([[r.get(k) for k in keys] for r in records], sort_keys=True, default=str)
    code = folds.source_digest(PREDICT_SOURCES).encode()
    return hashlib.sha256(text.encode() + hardware.encode() + code).hexdigest()[:16]


def attach_predictions(results: dict[str, Any], hardware: str = "cpu", cache: Path | None = None) -> None:
    """Add ``prediction`` to results.json (and ``predicted_tps_per_device`` / ``prediction_error`` to each record).
    With ``cache`` (a JSON file), predictions of unchanged inputs are read back instead of refitted (--report-only)."""
    key = cache_key(results["runs"], hardware)
    loo = None
    if cache is not None and cache.is_file():
        with contextlib.suppress(json.JSONDecodeError, OSError):
            saved = json.loads(cache.read_text())
            loo = saved["prediction"] if saved.get("key") == key else None
    if loo is None:
        started = time.perf_counter()
        loo = leave_one_out(results["runs"], hardware)
        loo["fit_s"] = round(time.perf_counter() - started, 1)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps({"key": key, "prediction": loo}))
    results["prediction"] = loo
    for record in results["runs"]:
        row = loo["runs"].get(record["name"], {})
        record["predicted_tps_per_device"] = row.get("predicted")
        record["prediction_error"] = row.get("error")
