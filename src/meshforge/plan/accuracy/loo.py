"""The planner judged on published runs it was not fitted to: an honest leave-one-out over plan/accuracy/published.py.

For every published row: fit the constants to all the other rows *from the neutral start* (``NEUTRAL``: the middle
of each constant's physical bounds, no reading of the rows), with the per-family speed factors of the GPU generations
the other rows determine, then predict the row (``fit.fit_time`` for tokens/s, ``fit.fit_memory`` for the peak). The
median of those errors is the planner's accuracy (docs/planner.md); the in-sample error of the fit to all rows (also
from the neutral start) is reported beside it, labelled as such. The folds are cached with a key over everything
they depend on (plan/accuracy/folds.py), so ``meshforge plan --article`` refits only when the physics or the rows
change.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from meshforge.config.io import load_config
from meshforge.plan.accuracy import fit, published
from meshforge.plan.hardware import Efficiency, HardwareProfile, load_hardware
from meshforge.plan.layout import layout_from_config
from meshforge.plan.physics.estimate import Estimate, estimate

IMPL = "torchtitan"
"""Every published row ran TorchTitan's code."""
TIME_NAMES = ("matmul", "attention", "float8_speedup", "memory_bandwidth", "network", "async_tp_overlap")
"""The shared throughput constants fitted to the published rows (those the rows cannot identify are dropped)."""
REFERENCE = "h100-96gb"
"""The family whose rows fix the shared constants (28 of the rows); every other GPU generation gets a factor."""
NEUTRAL = Efficiency(
    matmul=0.5,
    attention=0.5,
    float8_speedup=1.5,
    memory_bandwidth=0.5,
    network=0.5,
    async_tp_overlap=0.5,
    allocator_overhead=0.0,
    framework_gib=0.0,
)
"""Where every fit starts: the middle of each constant's physical bounds (fractions of a datasheet in (0, 1],
Float8's speedup in [1, 2], the share of TP communication async TP hides in [0, 1]); chosen without the rows."""
FAMILY_PRIOR_SD = 0.25
"""Prior spread of a GPU generation's speed factor (log): its kernels reach its datasheet within e^0.25 = 1.28x of
the reference family's fraction. Also the extra spread of a family with no row (gb200): hardware.py."""
ROW_LOG_SD = 0.1
"""The order of one row's log error (the leave-one-out spread), which sets the prior's weight against the rows."""
FAMILY_PRIOR_WEIGHT = (ROW_LOG_SD / FAMILY_PRIOR_SD) ** 2


def neutral(name: str = REFERENCE) -> HardwareProfile:
    """The preset ``name`` carrying the neutral start."""
    return HardwareProfile(load_hardware(name).spec, NEUTRAL)


def family(obs: fit.Observation) -> str:
    """The row's hardware family (its preset's name)."""
    return obs.hardware.name if obs.hardware else REFERENCE


@functools.lru_cache(maxsize=1)
def observations() -> tuple[fit.Observation, ...]:
    """Every published row as a fit observation on its own hardware preset."""
    out = []
    for run in published.RUNS:
        layout = layout_from_config(load_config(None, list(run.overrides)), run.world_size, impl=IMPL)
        layout = replace(layout, compiled_loss=run.compiled_loss and layout.compile)
        out.append(fit.Observation(run.key, layout, run.tps, run.memory_gib, hardware=load_hardware(run.hardware)))
    return tuple(out)


def _with(obs: fit.Observation, hw: HardwareProfile) -> HardwareProfile:
    """The observation's preset carrying ``hw``'s efficiency constants."""
    spec = (obs.hardware or hw).spec
    return HardwareProfile(spec, hw.efficiency)


@dataclass
class Fitted:
    """Constants fitted to some rows: time and memory statistics, the start they were fitted from."""

    time: fit.Fit
    memory: fit.MemoryFit
    start: HardwareProfile

    @property
    def profile(self) -> HardwareProfile:
        """The reference preset with the fitted shared constants (no family factor)."""
        return self.memory.apply(self.time.apply(self.start))

    def profile_for(self, obs: fit.Observation) -> HardwareProfile:
        """The observation's own preset with the fitted constants and its family's factor."""
        return self.memory.apply(fit.scaled(_with(obs, self.start), self.time.scale))


def family_names(obs: Sequence[fit.Observation]) -> list[str]:
    """The family factors the rows can determine: every family with a timed row but the reference."""
    return sorted({fit.FAMILY + family(o) for o in obs if o.tps_per_device and family(o) != REFERENCE})


def fit_rows(obs: Sequence[fit.Observation], start: HardwareProfile | None = None) -> Fitted:
    """Fit the throughput constants (shared + family factors), then the memory ones, to ``obs`` from ``start``
    (default: the neutral start)."""
    start = start or neutral()
    families = family_names(obs)
    time_fit = fit.fit_time(
        [_reframe(o, start) for o in obs],
        start,
        [*TIME_NAMES, *families],
        priors={n: FAMILY_PRIOR_WEIGHT for n in families},
    )
    return Fitted(time_fit, memory_fit(obs, time_fit.apply(start)), start)


def memory_fit(obs: Sequence[fit.Observation], profile: HardwareProfile) -> fit.MemoryFit:
    """allocator_overhead and framework_gib fitted to the rows with a measured peak (from zero: no reading)."""
    pairs = [(fit.allocated_gib(_reframe(o, profile), profile), o.peak_memory_gib) for o in obs if o.peak_memory_gib]
    return fit.fit_memory(pairs, NEUTRAL.allocator_overhead, NEUTRAL.framework_gib)


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
    family: str = REFERENCE

    @property
    def tps_error(self) -> float | None:
        return self.estimate.tps_per_device / self.tps - 1 if self.tps else None

    @property
    def memory_error(self) -> float | None:
        return self.estimate.peak_memory_gib / self.memory_gib - 1 if self.memory_gib else None


def predict(obs: fit.Observation, profile: HardwareProfile) -> Prediction:
    """The row on ``profile`` (already the row's own preset with its family's constants)."""
    est = estimate(obs.layout, profile)
    return Prediction(obs.name, est, obs.tps_per_device, obs.peak_memory_gib, family(obs))


def summary(preds: Sequence[Prediction]) -> dict[str, float]:
    """Median and maximum |relative error| of tokens/s and memory, and the log-error spreads (RMS)."""
    tps = [p.tps_error for p in preds if p.tps_error is not None]
    mem = [p.memory_error for p in preds if p.memory_error is not None]

    def stat(values: list[float], f: object) -> float:
        return float(f([abs(e) for e in values])) if values else 0.0  # type: ignore[operator]

    return {
        "tps_rows": len(tps),
        "memory_rows": len(mem),
        "tps_median": stat(tps, statistics.median),
        "tps_max": stat(tps, max),
        "memory_median": stat(mem, statistics.median),
        "memory_max": stat(mem, max),
        "tps_log_sd": float(np.sqrt(np.mean([math.log1p(e) ** 2 for e in tps]))) if tps else 0.0,
        "memory_log_sd": float(np.sqrt(np.mean([math.log1p(e) ** 2 for e in mem]))) if mem else 0.0,
    }


def by_family(preds: Sequence[Prediction]) -> dict[str, dict[str, float]]:
    """``summary`` per hardware family, the reference first."""
    names = sorted({p.family for p in preds}, key=lambda n: (n != REFERENCE, n))
    return {n: summary([p for p in preds if p.family == n]) for n in names}


def fold(obs: Sequence[fit.Observation], key: str) -> Fitted:
    """The fit to every row but ``key``, from the neutral start (nothing of the left-out row reaches it)."""
    return fit_rows([o for o in obs if o.name != key], neutral())


def fitted_from(scale: dict[str, float], memory: fit.MemoryFit) -> Fitted:
    """A Fitted rebuilt from stored multipliers (the cache): statistics are not stored, only what predicts."""
    time_fit = fit.Fit([], [], np.zeros((0, 0)), list(scale), 0.0, dict(scale))
    return Fitted(time_fit, replace(memory), neutral())
