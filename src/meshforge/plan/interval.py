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

import math
from dataclasses import dataclass

import numpy as np

from meshforge.plan.estimate import Estimate
from meshforge.plan.fit import jacobian_row
from meshforge.plan.hardware import HardwareProfile

COVARIANCE_NAMES = ("matmul", "attention", "float8_speedup", "memory_bandwidth", "network")
COVARIANCE = (
    (0.0172, 0.0004, -0.0073, -0.0361, -0.0193),
    (0.0004, 0.0057, -0.0018, -0.0088, -0.0018),
    (-0.0073, -0.0018, 0.0106, 0.0137, 0.0001),
    (-0.0361, -0.0088, 0.0137, 0.1569, 0.0221),
    (-0.0193, -0.0018, 0.0001, 0.0221, 0.0612),
)
"""Covariance of the GPU constants' log-multipliers from the fit to the published rows (plan/validate.py; a test
recomputes it). Used for GPU profiles; a calibrated CPU profile carries only its spread."""


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
    g = jacobian_row(est.layout, hw, COVARIANCE_NAMES)
    return float(g @ np.array(COVARIANCE) @ g)


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


def separable(a: Estimate, b: Estimate, ia: Interval) -> bool:
    """Whether b's point estimate lies outside a's interval (a is faster than b beyond the uncertainty)."""
    return b.tps_per_device < ia.tps_low or b.tps_per_device > ia.tps_high
