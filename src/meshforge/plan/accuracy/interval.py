"""The uncertainty of a prediction: an interval for tokens/s and peak memory, and a three-way memory verdict.

Half-width (log space) = sqrt(spread^2 + g C g^T): ``spread`` is the profile's leave-one-out RMS error
(``Efficiency.tps_log_sd`` / ``memory_log_sd``: how far predictions of rows the fit did not see land), ``C`` the fitted
constants' covariance (log-multipliers, the fit's Jacobian) and ``g`` the prediction's sensitivity to them, so a
layout that leans on a poorly determined constant (attention at long context, say) gets a wider interval. The interval
is +-1 standard deviation (about two chances in three). A stack profile predicting past what its runs measured (more
nodes than they spanned; on a CPU, more ranks) gets at least the measured one-node -> multi-node spread
(shipped.SPLIT_LOG_SD), whatever its runs' own spread (``tps_spread``); the interval names the spread it used.

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
    tps_log_sd: float = 0.0
    """The spread used for tokens/s (log), before the constants' covariance is added."""
    spread: str = ""
    """What that spread is (printed beside the interval)."""

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
            "tps_spread": round(self.tps_log_sd, 4),
            "tps_spread_is": self.spread,
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
    sd, what = tps_spread(est.layout, hw)
    half = math.sqrt(sd**2 + parameter_variance(est, hw))
    mem = hw.efficiency.memory_log_sd
    usable = est.capacity_gib - est.runtime_gib
    return Interval(
        est.tps_per_device * math.exp(-half),
        est.tps_per_device * math.exp(half),
        est.peak_memory_gib * math.exp(-mem),
        est.peak_memory_gib * math.exp(mem),
        usable,
        sd,
        what + ("; + constants' covariance" if hw.spec.is_gpu else ""),
    )


def unit(hw: HardwareProfile) -> str:
    """What a world size counts on ``hw``: GPUs, or ranks on a CPU host."""
    return "GPUs" if hw.spec.is_gpu else "ranks"


def past_runs(layout: Layout, hw: HardwareProfile) -> bool:
    """Whether ``layout`` is wider than a stack profile's runs measured: on GPU, more nodes than the widest run
    spanned; on a CPU host, more ranks than the widest run (False for a profile without runs)."""
    info = hw.stack
    if info is None or not info.world_sizes:
        return False
    most = max(info.world_sizes)
    if not hw.spec.is_gpu:
        return layout.world_size > most
    node = hw.spec.devices_per_node
    return -(-layout.world_size // node) > -(-most // node)


def tps_spread(layout: Layout, hw: HardwareProfile) -> tuple[float, str]:
    """(the tokens/s spread the interval uses, what it is): the profile's ``tps_log_sd``, widened to at least the
    measured one-node -> multi-node spread (shipped.SPLIT_LOG_SD) past what a stack profile's runs measured."""
    sd = hw.efficiency.tps_log_sd
    if past_runs(layout, hw):
        assert hw.stack is not None
        runs = f"past its runs on <= {max(hw.stack.world_sizes)} {unit(hw)}"
        split = f"shipped.SPLIT_LOG_SD {shipped.SPLIT_LOG_SD:.3f} (TorchTitan's measured 8 -> 64-512 GPU error)"
        if sd < shipped.SPLIT_LOG_SD:
            return shipped.SPLIT_LOG_SD, f"{split}, widened from the profile's {sd:.3f}: {runs}"
        return sd, f"the profile's spread {sd:.3f}, {runs}: at least {split}"
    if hw.spec.is_gpu and shipped.SOURCE_LOG_SD and abs(sd - shipped.SOURCE_LOG_SD) < 5e-5:
        return sd, (
            f"leave-one-source-out spread {sd:.3f}: covers {shipped.SOURCE_COVERAGE:.0%} of a new source's rows, "
            "measured"
        )
    return sd, f"the profile's spread {sd:.3f}"


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
