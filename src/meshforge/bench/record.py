"""One run's record in results.json: its setup, then figures over the steady-state steps of all its repetitions.

A repetition is one process (one `meshforge train` job) of the run; its first ``warmup_steps`` steps are not timed.
The figures pool the measured steps of every repetition that finished: the median with its bootstrap interval
(bench/stats.py), the inter-quartile range, the outlier steps. The raw per-step values are kept (``tps_steps``) so
that `meshforge bench compare` can bootstrap the change between two sweeps from the data themselves.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from meshforge.bench import stats
from meshforge.bench.spec import BenchMatrix, BenchRun

Repetition = dict[str, Any]
"""What run_one returns: index, status, error, wall_s, startup_s, metrics (the run's metrics.jsonl), command, load."""


def median_spread(values: list[float]) -> tuple[float | None, list[float] | None]:
    """Median and inter-quartile range [q1, q3] (both ends equal to the value for a single measurement)."""
    if not values:
        return None, None
    if len(values) == 1:
        return values[0], [values[0], values[0]]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), [q1, q3]


def _median(values: list[Any]) -> float | None:
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


def measured(matrix: BenchMatrix, rep: Repetition) -> list[dict[str, Any]]:
    """The steady-state steps of a finished repetition (after the warm-up steps)."""
    return [m for m in rep["metrics"] if m["step"] > matrix.warmup_steps] if rep["status"] == "ok" else []


def overall_status(reps: list[Repetition]) -> tuple[str, str]:
    """ok if every repetition finished; ok with a note if some did; else the first repetition's status and error."""
    bad = [r for r in reps if r["status"] != "ok"]
    if not bad:
        return "ok", ""
    if len(bad) < len(reps):
        return "ok", f"{len(bad)} of {len(reps)} repetitions did not finish ({bad[0]['status']}: {bad[0]['error']})"
    return reps[0]["status"], reps[0]["error"]


def throughput(matrix: BenchMatrix, reps: list[Repetition]) -> dict[str, Any]:
    """tokens/s per device: median, IQR, min/max, bootstrap interval, outlier steps, raw values per repetition."""
    steps = [[m["tps"] for m in measured(matrix, r)] for r in reps]
    steps = [s for s in steps if s]
    pooled = [v for s in steps for v in s]
    tps, iqr = median_spread(pooled)
    out: dict[str, Any] = {
        "tps_per_device": tps,
        "tps_per_device_iqr": iqr,
        "tps_per_device_min": min(pooled, default=None),
        "tps_per_device_max": max(pooled, default=None),
        "tps_per_device_ci": None,
        "tps_per_device_ci_half_width": None,
        "confidence": matrix.confidence,
        "tps_steps": steps,
        "outlier_steps": [],
    }
    if steps:
        interval = stats.median_ci(steps, matrix.confidence)
        first = matrix.warmup_steps + 1
        out |= {
            "tps_per_device_ci": interval.as_list(),
            "tps_per_device_ci_half_width": round(interval.half_width, 4),
            "outlier_steps": [[rep, first + i, round(v, 2)] for rep, i, v in stats.outliers(steps)],
        }
    return out


def make_record(matrix: BenchMatrix, run: BenchRun, reps: list[Repetition]) -> dict[str, Any]:
    """The results.json record of ``run`` from its repetitions (at least one)."""
    status, error = overall_status(reps)
    first_ok = next((r for r in reps if r["status"] == "ok"), reps[0])
    metrics = first_ok["metrics"]
    steady = [m for r in reps for m in measured(matrix, r)]
    tput = throughput(matrix, reps)
    tps = tput["tps_per_device"]
    return {
        "name": run.name,
        "label": run.describe() + (f", seq {run.seq_len}" if run.seq_len and run.seq_len != matrix.seq_len else ""),
        "group": run.group,
        "layout": run.layout(),
        "flags": matrix.flags_of(run),
        "flavor": matrix.flavor,
        "dtype": matrix.dtype,
        "seq_len": matrix.seq_len_of(run),
        "global_batch_size": matrix.global_batch_of(run),
        "local_batch_size": matrix.local_batch_size(run),
        "gradient_accumulation_steps": run.gradient_accumulation_steps,
        "world_size": run.ranks,
        "oversubscribed": matrix.oversubscribed(run),  # more ranks than cores: parity and memory, not ranked on speed
        "threads_per_rank": first_ok.get("threads_per_rank", matrix.threads_per_rank),
        "steps": matrix.steps,
        "warmup_steps": matrix.warmup_steps,
        "measured_steps": len(steady),
        "repeat": len(reps),
        **tput,
        "job_tps": None if tps is None else tps * run.ranks,
        "tflops": _median([m.get("tflops") for m in steady]),
        "mfu_pct": _median([m.get("mfu_pct") for m in steady]),
        "mfu_causal_pct": _median([m.get("mfu_causal_pct") for m in steady]),
        "peak_memory_gib": max((m["peak_memory_gib"] for m in steady), default=None),
        "step_time_s": _median([m.get("step_time_s") for m in steady]),
        "data_loading_pct": _median([m.get("data_loading_pct") for m in steady]),
        "bubble_pct": _median([m.get("bubble_pct") for m in steady]),
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "loss_curve": [[m["step"], m["loss"]] for m in metrics],
        "wall_s": _median([r["wall_s"] for r in reps if r["wall_s"]]),
        "startup_s": _median([r.get("startup_s") for r in reps]),
        "repetitions": [repetition_summary(matrix, r) for r in reps],
        "status": status,
        "error": error,
        "reference": run.reference,
        "command": first_ok["command"],
        "fingerprint": matrix.fingerprint(run),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "load_avg_1m": _median([r.get("load_avg_1m") for r in reps]),
    }


def repetition_summary(matrix: BenchMatrix, rep: Repetition) -> dict[str, Any]:
    """What results.json keeps of one repetition: when and how it ran, its median and its own time split."""
    steps = [m["tps"] for m in measured(matrix, rep)]
    return {
        "index": rep["index"],
        "status": rep["status"],
        "error": rep["error"],
        "tps_per_device": statistics.median(steps) if steps else None,
        "wall_s": rep["wall_s"],
        "startup_s": rep.get("startup_s"),
        "load_avg_1m": rep.get("load_avg_1m"),
        "finished_at": rep.get("finished_at"),
    }
