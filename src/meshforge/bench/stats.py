"""Statistics of repeated runs: medians with bootstrap confidence intervals, ratios, outliers, a separable ranking.

A run is repeated (``--repeat N``, each repetition its own process) and each repetition logs several steady-state
steps. Steps of one process are correlated (same memory layout, same neighbours on the cores), so a repetition is the
unit of evidence: the interval is Student's t over the repetitions' medians (in log space: tokens/s are positive and
their noise multiplicative), with n - 1 degrees of freedom, and the interval of a ratio is Welch's t on the difference
of the two runs' mean log medians. A two-level bootstrap (repetitions, then steps) was used before: with the default
3 repetitions it covered the true median 80-87 % of the time at a nominal 95 % (a bootstrap over 3 values cannot see
the tails), and called two identical runs separable 14 % of the time; the t interval holds its level at 3
(tests/unit/test_bench_stats.py simulates it). One repetition has no between-process spread to measure: its interval
is the bootstrap over its steps, which says only how noisy the steps of that one process were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as scipy_stats

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
IQR_FENCE = 1.5
"""Tukey's fences: a step beyond 1.5 inter-quartile ranges outside the quartiles of its run is an outlier."""
NOISY_HALF_WIDTH = 0.10
"""A run whose interval's half-width exceeds 10 % of its median is too noisy to rank with confidence."""

Samples = Sequence[Sequence[float]]
"""Per repetition, its steady-state per-step values (tokens/s per device)."""


@dataclass(frozen=True)
class Interval:
    """A median and its bootstrap confidence interval."""

    median: float
    low: float
    high: float
    confidence: float = CONFIDENCE

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the median (0.05: +-5 %)."""
        return (self.high - self.low) / 2 / abs(self.median) if self.median else float("inf")

    def excludes(self, value: float) -> bool:
        return not self.low <= value <= self.high

    def as_list(self) -> list[float]:
        return [self.low, self.high]


def _clean(samples: Samples) -> list[np.ndarray]:
    groups = [np.asarray(g, dtype=float) for g in samples if len(g)]
    if not groups:
        raise ValueError("no samples: a run with no measured step has no median")
    return groups


def bootstrap_medians(samples: Samples, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """``resamples`` medians of two-level bootstrap draws (repetitions, then steps within each), vectorised."""
    groups = _clean(samples)
    lengths = np.array([len(g) for g in groups])
    padded = np.full((len(groups), lengths.max()), np.nan)
    for i, g in enumerate(groups):
        padded[i, : len(g)] = g
    rng = np.random.default_rng(seed)
    picked = rng.integers(len(groups), size=(resamples, len(groups)))  # (resample, repetition drawn)
    size = lengths[picked][..., None]  # (resample, repetition, 1)
    steps = (rng.random((resamples, len(groups), lengths.max())) * size).astype(int)  # (resample, rep, step)
    values = padded[picked[..., None], steps]
    values[np.arange(lengths.max()) >= size] = np.nan  # a shorter repetition draws only its own count of steps
    return np.nanmedian(values.reshape(resamples, -1), axis=1)


def repetition_logs(samples: Samples) -> np.ndarray:
    """log of each repetition's median (NaN-free; ValueError without samples)."""
    meds = np.array([np.median(g) for g in _clean(samples)])
    if np.any(meds <= 0):
        raise ValueError("medians must be positive (tokens/s) for a log-scale interval")
    return np.log(meds)


def _t_interval(mean: float, se: float, dof: float, confidence: float) -> tuple[float, float]:
    if se == 0 or not np.isfinite(dof):
        return float(np.exp(mean)), float(np.exp(mean))
    half = float(scipy_stats.t.ppf((1 + confidence) / 2, dof)) * se
    return float(np.exp(mean - half)), float(np.exp(mean + half))


def median_ci(
    samples: Samples, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = SEED
) -> Interval:
    """The median of all values and its interval at ``confidence``: t over the repetitions' log medians (one
    repetition: the percentile bootstrap over its steps)."""
    groups = _clean(samples)
    point = float(np.median(np.concatenate(groups)))
    if len(groups) < 2:
        medians = bootstrap_medians(samples, resamples, seed)
        tail = (1 - confidence) / 2 * 100
        low, high = np.percentile(medians, [tail, 100 - tail])
        return Interval(point, float(low), float(high), confidence)
    logs = repetition_logs(samples)
    low, high = _t_interval(float(logs.mean()), float(logs.std(ddof=1) / np.sqrt(len(logs))), len(logs) - 1, confidence)
    return Interval(point, low, high, confidence)


def ratio_ci(
    numerator: Samples,
    denominator: Samples,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Interval:
    """median(numerator) / median(denominator) and its interval: Welch's t on the difference of mean log repetition
    medians (either side with one repetition: the two bootstrapped independently, steps only)."""
    top, bottom = _clean(numerator), _clean(denominator)
    point = float(np.median(np.concatenate(top)) / np.median(np.concatenate(bottom)))
    if len(top) < 2 or len(bottom) < 2:
        ratios = bootstrap_medians(numerator, resamples, seed) / bootstrap_medians(denominator, resamples, seed + 1)
        tail = (1 - confidence) / 2 * 100
        low, high = np.percentile(ratios, [tail, 100 - tail])
        return Interval(point, float(low), float(high), confidence)
    a, b = repetition_logs(numerator), repetition_logs(denominator)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = float(np.sqrt(va + vb))
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if va + vb > 0 else float("inf")
    low, high = _t_interval(float(a.mean() - b.mean()), se, dof, confidence)
    return Interval(point, low, high, confidence)


def outliers(samples: Samples, fence: float = IQR_FENCE) -> list[tuple[int, int, float]]:
    """(repetition, step index within it, value) of every value beyond Tukey's fences of all values pooled."""
    groups = _clean(samples)
    q1, q3 = np.percentile(np.concatenate(groups), [25, 75])
    low, high = q1 - fence * (q3 - q1), q3 + fence * (q3 - q1)
    return [(rep, i, float(v)) for rep, group in enumerate(groups) for i, v in enumerate(group) if not low <= v <= high]


@dataclass(frozen=True)
class Ranked:
    """One place of a ranking: the run, its interval, and whether it is separable from the next one down."""

    name: str
    interval: Interval
    separable_from_next: bool | None  # None for the last place
    ratio_to_next: Interval | None


def ranking(runs: dict[str, Samples], confidence: float = CONFIDENCE, seed: int = SEED) -> list[Ranked]:
    """Runs from fastest to slowest median; each place says whether the ratio to the next one's interval excludes 1
    (the difference is beyond noise at ``confidence``) or not (the two cannot be told apart by these data)."""
    intervals = {name: median_ci(s, confidence, seed=seed) for name, s in runs.items()}
    order = sorted(intervals, key=lambda n: -intervals[n].median)
    places = []
    for i, name in enumerate(order):
        nxt = order[i + 1] if i + 1 < len(order) else None
        ratio = ratio_ci(runs[name], runs[nxt], confidence, seed=seed) if nxt else None
        places.append(Ranked(name, intervals[name], ratio.excludes(1.0) if ratio else None, ratio))
    return places


def separable_pairs(runs: dict[str, Samples], confidence: float = CONFIDENCE, seed: int = SEED) -> dict[str, str]:
    """For every pair whose ratio interval excludes 1: "a>b" -> the faster's name. (Pairs are keyed "a|b", a < b.)"""
    names = sorted(runs)
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ratio = ratio_ci(runs[a], runs[b], confidence, seed=seed)
            if ratio.excludes(1.0):
                out[f"{a}|{b}"] = a if ratio.median > 1 else b
    return out


MEDIAN_EFFICIENCY = float(np.pi / 2)
"""Variance of the median of k normal values ~ (pi / 2) sigma^2 / k."""


def optimal_steps(start_s: float, step_s: float, within_var: float, between_var: float, cap: int = 16) -> int:
    """Measured steps per start-up that give the narrowest interval per second of sweep (two-stage sampling): a
    repetition costs ``start_s`` (start-up and warm-up) + k ``step_s`` and its median varies by ``between_var`` (the
    process) + (pi/2) ``within_var`` / k (its steps), so k* = sqrt((pi/2) within_var start_s / (between_var step_s)).
    Where the steps of one process are the noise (between_var ~ 0), ``cap``."""
    if step_s <= 0 or within_var <= 0:
        return 1
    if between_var <= 0:
        return cap
    k = np.sqrt(MEDIAN_EFFICIENCY * within_var * max(start_s, 0.0) / (between_var * step_s))
    return int(min(cap, max(1, round(float(k)))))


def variance_parts(samples: Samples, steps: int) -> tuple[float, float] | None:
    """(within, between) variance of log tokens/s: the steps' around their repetition, and the repetitions' own
    (their medians' variance less what the steps explain); None with fewer than two repetitions of two steps."""
    groups = [np.log(g) for g in _clean(samples) if len(g) >= 2]
    if len(groups) < 2:
        return None
    within = float(np.mean([g.var(ddof=1) for g in groups]))
    medians = np.array([np.median(g) for g in groups])
    return within, max(0.0, float(medians.var(ddof=1)) - MEDIAN_EFFICIENCY * within / max(1, steps))
