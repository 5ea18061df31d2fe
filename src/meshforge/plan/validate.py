"""The planner judged on published runs it was not fitted to: leave-one-out cross-validation over plan/published.py.

For every published row: fit the constants to all the other rows (``fit.fit_time`` for tokens/s, ``fit.fit_memory``
for the peak), predict the row, compare. The median of those errors is the planner's accuracy (docs/planner.md);
the in-sample error of the fit to all rows is reported beside it, labelled as such. The spread of the leave-one-out
errors, with the fit's covariance, is what ``plan/interval.py`` puts around every prediction.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshforge.config.io import load_config
from meshforge.plan import fit, interval, published
from meshforge.plan.estimate import Estimate, estimate
from meshforge.plan.hardware import HardwareProfile, load_hardware
from meshforge.plan.layout import layout_from_config

IMPL = "torchtitan"
"""Every published row ran TorchTitan's code."""
TIME_NAMES = ("matmul", "attention", "float8_speedup", "memory_bandwidth", "network", "async_tp_overlap")
"""The throughput constants fitted to the published rows (those the rows cannot identify are dropped)."""
REFERENCE = "h100-96gb"
"""The preset whose efficiency defaults are the fit's start (every GPU preset shares them)."""


@functools.lru_cache(maxsize=1)
def observations() -> tuple[fit.Observation, ...]:
    """Every published row as a fit observation on its own hardware preset."""
    out = []
    for run in published.RUNS:
        layout = layout_from_config(load_config(None, list(run.overrides)), run.world_size, impl=IMPL)
        out.append(fit.Observation(run.key, layout, run.tps, run.memory_gib, hardware=load_hardware(run.hardware)))
    return tuple(out)


def _with(obs: fit.Observation, hw: HardwareProfile) -> HardwareProfile:
    """The observation's preset carrying ``hw``'s efficiency constants."""
    spec = (obs.hardware or hw).spec
    return HardwareProfile(spec, hw.efficiency)


@dataclass
class Fitted:
    """A profile fitted to some rows: time and memory statistics."""

    time: fit.Fit
    memory: fit.MemoryFit
    profile: HardwareProfile
    """The reference preset with the fitted efficiency constants."""


def fit_rows(obs: Sequence[fit.Observation], start: HardwareProfile) -> Fitted:
    """Fit the throughput constants, then the memory ones, to ``obs``."""
    time_fit = fit.fit_time([_reframe(o, start) for o in obs], start, TIME_NAMES)
    return Fitted(time_fit, *_memory(obs, time_fit.apply(start)))


def _memory(
    obs: Sequence[fit.Observation], profile: HardwareProfile, skip: str = ""
) -> tuple[fit.MemoryFit, HardwareProfile]:
    pairs = [
        (fit.allocated_gib(_reframe(o, profile), profile), o.peak_memory_gib)
        for o in obs
        if o.peak_memory_gib and o.name != skip
    ]
    eff = profile.efficiency
    mem_fit = fit.fit_memory(pairs, eff.allocator_overhead, eff.framework_gib)
    return mem_fit, mem_fit.apply(profile)


def _reframe(obs: fit.Observation, hw: HardwareProfile) -> fit.Observation:
    """The observation on its own spec with ``hw``'s efficiency (what the fit scales)."""
    return fit.Observation(obs.name, obs.layout, obs.tps_per_device, obs.peak_memory_gib, hardware=_with(obs, hw))


@dataclass(frozen=True)
class Prediction:
    """One published row predicted by a fit that did (in-sample) or did not (leave-one-out) see it."""

    key: str
    estimate: Estimate
    tps: float | None
    memory_gib: float | None

    @property
    def tps_error(self) -> float | None:
        return self.estimate.tps_per_device / self.tps - 1 if self.tps else None

    @property
    def memory_error(self) -> float | None:
        return self.estimate.peak_memory_gib / self.memory_gib - 1 if self.memory_gib else None


def predict(obs: fit.Observation, profile: HardwareProfile) -> Prediction:
    est = estimate(obs.layout, _with(obs, profile))
    return Prediction(obs.name, est, obs.tps_per_device, obs.peak_memory_gib)


def summary(preds: Sequence[Prediction]) -> dict[str, float]:
    """Median and maximum |relative error| of tokens/s and memory, and the log-error spreads (RMS)."""
    tps = [p.tps_error for p in preds if p.tps_error is not None]
    mem = [p.memory_error for p in preds if p.memory_error is not None]
    return {
        "tps_rows": len(tps),
        "memory_rows": len(mem),
        "tps_median": statistics.median(abs(e) for e in tps),
        "tps_max": max(abs(e) for e in tps),
        "memory_median": statistics.median(abs(e) for e in mem),
        "memory_max": max(abs(e) for e in mem),
        "tps_log_sd": float(np.sqrt(np.mean([math.log1p(e) ** 2 for e in tps]))),
        "memory_log_sd": float(np.sqrt(np.mean([math.log1p(e) ** 2 for e in mem]))),
    }


@dataclass
class Validation:
    """The fit to every published row, its in-sample predictions, and the leave-one-out predictions."""

    fitted: Fitted
    in_sample: list[Prediction]
    loo: list[Prediction]


def validation(start: HardwareProfile | None = None) -> Validation:
    """Fit once to every row, predict every row in-sample, then leave each one out (plan --article, the tests)."""
    start = start or load_hardware(REFERENCE)
    obs = observations()
    full = fit_rows(obs, start)
    framed = [_reframe(o, start) for o in obs]
    timed = [o.name for o in framed if o.tps_per_device and not o.emulated]
    loo = []
    for o in obs:
        time_fit = fit.refit_without(framed, start, full.time, timed.index(o.name)) if o.name in timed else full.time
        _, profile = _memory(obs, time_fit.apply(start), skip=o.name)
        loo.append(predict(o, profile))
    return Validation(full, [predict(o, full.profile) for o in obs], loo)


def row_interval(pred: Prediction, profile: HardwareProfile) -> interval.Interval:
    """The prediction's interval on the row's own hardware with ``profile``'s constants."""
    obs = next(o for o in observations() if o.name == pred.key)
    return interval.interval(pred.estimate, _with(obs, profile))


def format_validation(v: Validation) -> str:
    """Leave-one-out (the accuracy) and in-sample errors of every published row, as Markdown, with the sources."""
    runs = {r.key: r for r in published.RUNS}
    lines = [
        "| row | source | hardware | TPS/GPU published | LOO predicted | LOO error | in-sample error | "
        "memory GiB published | LOO predicted | LOO error | in-sample error | LOO memory verdict |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for loo, ins in zip(v.loo, v.in_sample, strict=True):
        run, e = runs[loo.key], loo.estimate
        iv = row_interval(loo, v.fitted.profile)
        mem = (
            f"{run.memory_gib:.1f} | {e.peak_memory_gib:.1f} | {loo.memory_error:+.1%} | {ins.memory_error:+.1%}"
            if loo.memory_error is not None and ins.memory_error is not None
            else f"- | {e.peak_memory_gib:.1f} | - | -"
        )
        lines.append(
            f"| {run.name} | {run.source} | {run.hardware} | {run.tps:,.0f} | {e.tps_per_device:,.0f} | "
            f"{loo.tps_error or 0:+.1%} | {ins.tps_error or 0:+.1%} | {mem} | {iv.verdict} "
            f"({iv.memory_low:.0f}-{iv.memory_high:.0f} of {iv.usable_gib:.0f}) |"
        )
    s, i = summary(v.loo), summary(v.in_sample)
    lines.append(
        f"\nleave-one-out median |error|: TPS {s['tps_median']:.1%} ({s['tps_rows']} rows), memory "
        f"{s['memory_median']:.1%} ({s['memory_rows']} rows); max {s['tps_max']:.1%} / {s['memory_max']:.1%}. "
        f"In-sample (not an accuracy): {i['tps_median']:.1%} / {i['memory_median']:.1%}."
    )
    return "\n".join(lines)
