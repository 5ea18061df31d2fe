"""The uncertainty of a prediction: an interval for tokens/s and peak memory, and a three-way memory verdict.

Half-width (log space) = sqrt(spread^2 + g C g^T): ``spread`` is the profile's leave-one-out RMS error
(``Efficiency.tps_log_sd`` / ``memory_log_sd``: how far predictions of rows the fit did not see land), ``C`` the fitted
constants' covariance (log-multipliers, the fit's Jacobian) and ``g`` the prediction's sensitivity to them, so a
layout that leans on a poorly determined constant (attention at long context, say) gets a wider interval. The interval
is +-1 standard deviation (about two chances in three).

Memory: "fits" when the high end is within the usable memory, "does not fit" when the low end is beyond it, "tight"
in between, with the margin of the point estimate.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from meshforge.plan import shipped
from meshforge.plan.accuracy.fit import jacobian_row
from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.layout import Layout
from meshforge.plan.physics.estimate import Estimate

COVARIANCE_NAMES: tuple[str, ...] = shipped.COVARIANCE_NAMES
COVARIANCE: tuple[tuple[float, ...], ...] = shipped.COVARIANCE
"""Covariance of the GPU constants' log-multipliers (the shared ones and the family factors) from the fit to the
published rows (plan/accuracy/loo.py, kept in plan/shipped.py; a test recomputes it). Used for GPU profiles; a
calibrated CPU profile carries only its spread."""
SEPARABLE_Z = 1.0
"""Two layouts are separable when their predicted log ratio exceeds this many standard deviations of a predicted
ratio's error (as the intervals: one)."""


@dataclass(frozen=True)
class Interval:
    """+-1 standard deviation around a prediction."""

    tps_low: float
    tps_high: float
    memory_low: float
    memory_high: float
    usable_gib: float

    @property
    def verdict(self) -> str:
        """fits / tight / does not fit."""
        if self.memory_high <= self.usable_gib:
            return "fits"
        return "does not fit" if self.memory_low > self.usable_gib else "tight"

    def as_dict(self) -> dict[str, float | str]:
        return {
            "tps_low": round(self.tps_low, 2),
            "tps_high": round(self.tps_high, 2),
            "memory_low": round(self.memory_low, 2),
            "memory_high": round(self.memory_high, 2),
            "memory_verdict": self.verdict,
        }


def parameter_variance(est: Estimate, hw: HardwareProfile) -> float:
    """g C g^T: the variance of log(tokens/s) the constants' uncertainty gives this layout (0 off GPU)."""
    if not hw.spec.is_gpu:
        return 0.0
    return _variance(est.layout, hw, COVARIANCE_NAMES, COVARIANCE)


@functools.lru_cache(maxsize=4096)
def _variance(layout: Layout, hw: HardwareProfile, names: tuple[str, ...], cov: tuple[tuple[float, ...], ...]) -> float:
    """``parameter_variance`` of a layout, once per (layout, hardware, constants): a guide cell summarises the same
    layout as its recommendation and as its family's best (9 estimates each, pipeline simulations included)."""
    g = jacobian_row(layout, hw, names)
    return float(g @ np.array(cov) @ g)


def interval(est: Estimate, hw: HardwareProfile) -> Interval:
    """The prediction's interval on ``hw``."""
    eff = hw.efficiency
    half = math.sqrt(eff.tps_log_sd**2 + parameter_variance(est, hw))
    mem = eff.memory_log_sd
    usable = est.capacity_gib - est.runtime_gib
    return Interval(
        est.tps_per_device * math.exp(-half),
        est.tps_per_device * math.exp(half),
        est.peak_memory_gib * math.exp(-mem),
        est.peak_memory_gib * math.exp(mem),
        usable,
    )


def difference_log_sd(hw: HardwareProfile) -> float:
    """Spread of a predicted ratio of two layouts on ``hw`` (log): the published rows' paired leave-one-out errors
    (shipped.DIFF_LOG_SD) on GPU presets; off GPU (a calibrated profile) sqrt(2) x its spread (errors independent)."""
    if hw.spec.is_gpu and shipped.DIFF_LOG_SD:
        return shipped.DIFF_LOG_SD
    return math.sqrt(2) * hw.efficiency.tps_log_sd


def difference_sd(a: Estimate, b: Estimate, hw: HardwareProfile) -> float:
    """Standard deviation of log(b / a) predicted: the paired spread plus (g_b - g_a) C (g_b - g_a)^T, the part of
    the constants' uncertainty that does not cancel between the two."""
    var = difference_log_sd(hw) ** 2
    if hw.spec.is_gpu:
        names = COVARIANCE_NAMES
        g = jacobian_row(b.layout, hw, names) - jacobian_row(a.layout, hw, names)
        var += float(g @ np.array(COVARIANCE) @ g)
    return math.sqrt(var)


def separable(a: Estimate, b: Estimate, ia: Interval | None = None, hw: HardwareProfile | None = None) -> bool:
    """Whether b and a are told apart: with ``hw``, a test of their difference (|log(b / a)| beyond SEPARABLE_Z
    standard deviations of a predicted ratio, difference_sd), in which the error common to both cancels; without,
    whether b's point estimate lies outside a's interval ``ia`` (the earlier rule, for callers that pass only it)."""
    if hw is not None:
        return abs(math.log(b.tps_per_device / a.tps_per_device)) > SEPARABLE_Z * difference_sd(a, b, hw)
    if ia is None:
        raise ValueError("separable needs the hardware (a difference test) or a's interval")
    return b.tps_per_device < ia.tps_low or b.tps_per_device > ia.tps_high
