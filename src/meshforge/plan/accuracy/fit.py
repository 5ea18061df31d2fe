"""Least-squares fits of a profile's constants to measured runs, with standard errors and what determines each.

Throughput: ``scipy.optimize.least_squares`` (trust-region reflective, bounded) over the log-multipliers of the named
constants, residuals log(predicted / measured tokens/s), plus a weak pull toward the starting values (``prior``
residuals sqrt(prior) x log-multiplier) where the runs cannot tell two constants apart. Memory: the peak is
allocated x (1 + allocator_overhead) + framework_gib, fitted by the same solver on relative error (bounded >= 0).

Standard errors come from the Jacobian at the solution: cov = s^2 (J^T J)^-1 with s^2 the residual variance (the
residuals' sum of squares over rows - constants). A constant no row moves, or whose standard error exceeds a factor
of e (log-SE > 1), is dropped (held at its start) and the fit repeated: the data cannot identify it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from meshforge.config.io import ConfigError
from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.layout import Layout
from meshforge.plan.physics.estimate import estimate

LOG_RANGE = math.log(100.0)
"""A fitted constant stays within 100x of its starting value either way (unless BOUNDS is tighter)."""
BOUNDS: dict[str, tuple[float, float]] = {
    "matmul": (1e-3, 1.0),
    "attention": (1e-3, 1.0),
    "memory_bandwidth": (1e-3, 1.0),
    "network": (1e-3, 1.0),
    "float8_speedup": (1.0, 2.0),
    "async_tp_overlap": (1e-3, 1.0),
}
"""Physical limits: efficiencies are fractions of the datasheet, Float8 at most doubles a bf16 matmul."""
UNIDENTIFIED_LOG_SE = 1.0
"""A constant whose log standard error exceeds this (a factor of e either way) is not determined by the runs."""
TOLERANCE = 1e-6
"""Relative change of the cost and of the parameters at which the solver stops (1e-6 of a log: far below the data's
noise; the default 1e-8 costs several more passes over every run)."""
DETERMINES_SHARE = 0.5
"""The rows that 'determine' a constant: the fewest (at most five) that carry this share of the squared norm of its
Jacobian column (how much each row's residual moves with it). No row at all: no run moves it."""
NEGLIGIBLE = 1e-6
"""A Jacobian column with a squared norm below this: no run moves the constant."""


@dataclass(frozen=True)
class Observation:
    """One measured run: its layout and what it achieved (on ``hardware``, or the fit's profile when None)."""

    name: str
    layout: Layout
    tps_per_device: float
    peak_memory_gib: float | None
    emulated: bool = False
    """Float8 emulated in high precision (a CPU run): its time is not Float8's, so it is reported but not fitted."""
    hardware: HardwareProfile | None = None


@dataclass(frozen=True)
class Constant:
    """A fitted constant: its multiplier on the starting value, the log standard error (the relative standard error
    of the value), and the runs that pin it down."""

    name: str
    multiplier: float
    log_se: float
    determined_by: tuple[str, ...]


@dataclass
class Fit:
    """The fitted profile(s), each constant's statistics, what was dropped, and the log-space covariance."""

    constants: list[Constant]
    dropped: list[tuple[str, str]]
    covariance: np.ndarray
    names: list[str]
    residual_sd: float
    scale: dict[str, float] = field(default_factory=dict)
    """Multiplier applied to each fitted constant's starting value."""
    jacobian: np.ndarray | None = None
    """d residual / d log-multiplier of every fitted run at the solution (rows: the runs, in order)."""

    def apply(self, hw: HardwareProfile) -> HardwareProfile:
        """``hw`` with the fitted multipliers applied."""
        return scaled(hw, self.scale)


FAMILY = "family:"
"""Prefix of a hardware family's speed factor (``family:a100``): a multiplier on FAMILY_SCALES of that preset only,
so each GPU generation's efficiencies are the shared ones times a factor its own rows determine."""
FAMILY_SCALES = ("matmul", "attention")
"""What a family factor multiplies: the tensor-core efficiencies (how close a generation's kernels get to its
datasheet peak; element-wise kernels are bound by memory bandwidth, which stays shared)."""


def scaled(hw: HardwareProfile, scale: dict[str, float]) -> HardwareProfile:
    """``hw`` with efficiency constants / numeric spec fields multiplied (the fit's bounds keep them in BOUNDS);
    ``family:NAME`` factors multiply FAMILY_SCALES when ``hw`` is the preset NAME and are ignored otherwise."""
    eff_kw: dict[str, Any] = {}
    spec_kw: dict[str, Any] = {}
    for name, s in scale.items():
        if name.startswith(FAMILY):
            continue
        if hasattr(hw.efficiency, name):
            eff_kw[name] = getattr(hw.efficiency, name) * s
        else:
            spec_kw[name] = getattr(hw.spec, name) * s
    family = scale.get(FAMILY + hw.name, 1.0)
    for name in FAMILY_SCALES if family != 1.0 else ():
        eff_kw[name] = eff_kw.get(name, getattr(hw.efficiency, name)) * family
    return replace(hw, spec=replace(hw.spec, **spec_kw), efficiency=replace(hw.efficiency, **eff_kw))


FAMILY_BOUNDS = (0.5, 2.0)
"""A family factor stays within 2x of the shared efficiencies either way."""


def _log_bounds(names: Sequence[str], hw: HardwareProfile) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = [], []
    for n in names:
        if n.startswith(FAMILY):
            lo.append(math.log(FAMILY_BOUNDS[0]))
            hi.append(math.log(FAMILY_BOUNDS[1]))
            continue
        start = value(hw, n)
        b_lo, b_hi = BOUNDS.get(n, (0.0, math.inf))
        lo.append(max(-LOG_RANGE, math.log(b_lo / start)) if b_lo > 0 and start > 0 else -LOG_RANGE)
        hi.append(min(LOG_RANGE, math.log(b_hi / start)) if start > 0 and b_hi < math.inf else LOG_RANGE)
    lo_a, hi_a = np.array(lo), np.array(hi)
    return np.minimum(lo_a, -1e-9), np.maximum(hi_a, 1e-9)  # the start is always inside


def check_names(names: Sequence[str], hw: HardwareProfile) -> None:
    for n in names:
        if n.startswith(FAMILY):
            continue
        if not hasattr(hw.efficiency, n) and not isinstance(getattr(hw.spec, n, None), float):
            raise ConfigError(f"cannot fit {n!r}: not an efficiency constant or a numeric hardware field")


def fit_time(
    obs: Sequence[Observation],
    hw: HardwareProfile,
    names: Sequence[str],
    prior: float = 0.0,
    x0: Sequence[float] | None = None,
    priors: dict[str, float] | None = None,
) -> Fit:
    """Fit the named constants' multipliers to the runs' tokens/s (log error); drop what the runs cannot identify.
    ``prior`` pulls every log-multiplier toward 0 (the start) with that weight, ``priors`` single names with theirs."""
    check_names(names, hw)
    runs = [o for o in obs if o.tps_per_device and not o.emulated]
    active, dropped = list(names), list[tuple[str, str]]()
    start = dict(zip(names, x0, strict=True)) if x0 is not None else {}
    while True:
        weights = [prior + (priors or {}).get(n, 0.0) for n in active]
        solution, jac, resid = _solve(runs, hw, active, weights, [start.get(n, 0.0) for n in active])
        fitted = fit_statistics([o.name for o in runs], active, solution, jac, resid, weights)
        bad = [c for c in fitted.constants if _unidentified(c, hw)]
        if not bad or not active:
            fitted.dropped, fitted.jacobian = dropped, jac
            return fitted
        worst = max(bad, key=lambda c: c.log_se)
        reason = "no run moves it" if not worst.determined_by else f"log standard error > {UNIDENTIFIED_LOG_SE}"
        dropped.append((worst.name, reason))
        active.remove(worst.name)
        start = dict(solution)  # warm start: the rest barely moves


def _unidentified(c: Constant, hw: HardwareProfile) -> bool:
    return not c.determined_by or c.log_se > UNIDENTIFIED_LOG_SE


def _solve(
    runs: Sequence[Observation],
    hw: HardwareProfile,
    names: Sequence[str],
    weights: Sequence[float],
    x0: Sequence[float],
) -> tuple[dict[str, float], np.ndarray, np.ndarray]:
    """The least-squares solution (name -> log-multiplier), the Jacobian and the residuals of the runs there."""
    if not names:
        return {}, np.zeros((len(runs), 0)), np.zeros(0)
    lo, hi = _log_bounds(names, hw)
    root = np.sqrt(np.array(weights, dtype=float))

    def residuals(x: np.ndarray) -> np.ndarray:
        scale = {n: math.exp(v) for n, v in zip(names, x, strict=True)}
        out = [_log_error(o, hw, scale) for o in runs]
        return np.concatenate([np.array(out), root * x])

    x_start = np.clip(np.array(x0, dtype=float), lo, hi)
    result = least_squares(
        residuals, x_start, bounds=(lo, hi), method="trf", diff_step=1e-4, ftol=TOLERANCE, xtol=TOLERANCE
    )
    n = len(runs)
    return dict(zip(names, result.x, strict=True)), result.jac[:n], result.fun[:n]


def fit_statistics(
    runs: Sequence[str],
    names: Sequence[str],
    solution: dict[str, float],
    jac: np.ndarray,
    resid: np.ndarray,
    prior: float | Sequence[float] = 0.0,
) -> Fit:
    """Standard errors (log space, delta method for the values) and determining rows from the Jacobian."""
    k = len(names)
    scale = {n: math.exp(v) for n, v in solution.items()}
    if k == 0:
        return Fit([], [], np.zeros((0, 0)), [], 0.0, scale)
    dof = max(1, len(runs) - k)
    s2 = float(resid @ resid) / dof
    info = jac.T @ jac + np.diag(np.broadcast_to(np.asarray(prior, dtype=float), (k,)))
    cov = s2 * np.linalg.pinv(info)
    constants: list[Constant] = []
    col = (jac**2).sum(axis=0)
    for i, n in enumerate(names):
        if col[i] < NEGLIGIBLE:
            constants.append(Constant(n, scale[n], math.inf, ()))
            continue
        share = jac[:, i] ** 2 / col[i]
        order = np.argsort(-share)
        cumulative = np.cumsum(share[order])
        top = [runs[j] for j, c in zip(order, cumulative, strict=True) if c - share[j] < DETERMINES_SHARE][:5]
        constants.append(Constant(n, scale[n], math.sqrt(max(0.0, cov[i, i])), tuple(top)))
    return Fit(constants, [], cov, list(names), math.sqrt(s2), scale)


def value(hw: HardwareProfile, name: str) -> float:
    """A constant's value on ``hw`` (an efficiency field or a numeric spec field; a family factor: 1, its start)."""
    if name.startswith(FAMILY):
        return 1.0
    return float(getattr(hw.efficiency, name) if hasattr(hw.efficiency, name) else getattr(hw.spec, name))


def _log_error(o: Observation, hw: HardwareProfile, scale: dict[str, float]) -> float:
    return math.log(estimate(o.layout, scaled(o.hardware or hw, scale)).tps_per_device / o.tps_per_device)


# --- memory ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryFit:
    """allocator_overhead and framework_gib, their standard errors, the residual spread (relative), what was merged."""

    allocator_overhead: float
    framework_gib: float
    stderr: tuple[float, float]
    residual_sd: float
    merged: str = ""
    """Why one of the two is held at zero, if it is."""

    def apply(self, hw: HardwareProfile) -> HardwareProfile:
        eff = replace(hw.efficiency, allocator_overhead=self.allocator_overhead, framework_gib=self.framework_gib)
        return replace(hw, efficiency=eff)


MERGE_CORRELATION = 0.95
"""Above this |correlation| of the two memory constants' estimates, the rows cannot tell a fixed overhead from a
proportional one: only the proportional slack is fitted."""


def allocated_gib(obs: Observation, hw: HardwareProfile) -> float:
    """The model's allocated peak for a run, before allocator slack and the fixed framework overhead."""
    p = obs.hardware or hw
    eff = p.efficiency
    return (estimate(obs.layout, p).peak_memory_gib - eff.framework_gib) / (1 + eff.allocator_overhead)


def fit_memory(pairs: Sequence[tuple[float, float]], slack: float, framework: float) -> MemoryFit:
    """Fit (allocator_overhead, framework_gib) >= 0 to (allocated, measured) pairs by relative error; where the two
    cannot be told apart (fewer than three distinct sizes, or correlated beyond MERGE_CORRELATION), the slack alone."""
    a = np.array([p[0] for p in pairs])
    m = np.array([p[1] for p in pairs])
    if len({round(float(x), 3) for x in a}) > 2:
        both = _memory_solve(a, m, [max(slack, 0.0), max(framework, 0.0)], True)
        cov = both[2]
        corr = cov[0, 1] / math.sqrt(cov[0, 0] * cov[1, 1]) if cov[0, 0] > 0 and cov[1, 1] > 0 else 0.0
        if abs(corr) <= MERGE_CORRELATION:
            x, sd, cov = both
            return MemoryFit(float(x[0]), float(x[1]), (_se(cov, 0), _se(cov, 1)), sd)
        reason = f"framework_gib merged into allocator_overhead (estimates correlated {corr:+.2f})"
        x, sd, cov = _memory_solve(a, m, [max(slack, 0.0)], False)
        return MemoryFit(float(x[0]), 0.0, (_se(cov, 0), 0.0), sd, reason)
    x, sd, cov = _memory_solve(a, m, [max(framework, 0.0)], False, fixed_slack=slack)
    return MemoryFit(slack, float(x[0]), (0.0, _se(cov, 0)), sd, "fewer than three distinct sizes: slack held")


def _se(cov: np.ndarray, i: int) -> float:
    return math.sqrt(max(0.0, float(cov[i, i])))


def _memory_solve(
    a: np.ndarray, m: np.ndarray, x0: list[float], both: bool, fixed_slack: float | None = None
) -> tuple[np.ndarray, float, np.ndarray]:
    """Least squares on relative error: both (slack, fixed), the slack alone (fixed = 0), or the fixed part alone."""

    def model(x: np.ndarray) -> np.ndarray:
        if both:
            return (a * (1 + x[0]) + x[1]) / m - 1
        if fixed_slack is None:
            return a * (1 + x[0]) / m - 1
        return (a * (1 + fixed_slack) + x[0]) / m - 1

    upper = np.array([2.0, 100.0] if both else [100.0 if fixed_slack is not None else 2.0])
    # strictly inside the bounds: trf's Coleman-Li scaling is |x - bound|, so a start on the lower bound (the neutral
    # slack 0) never moves, whatever the residuals (it held the slack at 0 with every H100 row 10-28 % above)
    inside = np.clip(np.array(x0, dtype=float), 0.01 * upper, 0.99 * upper)
    res = least_squares(model, inside, bounds=(np.zeros(len(x0)), upper), method="trf")
    dof = max(1, len(m) - len(x0))
    s2 = float(res.fun @ res.fun) / dof
    return res.x, math.sqrt(s2), s2 * np.linalg.pinv(res.jac.T @ res.jac)


def jacobian_row(layout: Layout, hw: HardwareProfile, names: Sequence[str], step: float = 1e-3) -> np.ndarray:
    """d log(tokens/s) / d log(constant) for one layout (forward differences)."""
    base = math.log(estimate(layout, hw).tps_per_device)
    out = [(math.log(estimate(layout, scaled(hw, {n: math.exp(step)})).tps_per_device) - base) / step for n in names]
    return np.array(out)
