"""Calibrate the memory constants to measured peaks: only what the runs identify, judged on runs left out.

What a run's memory figure is (observability/metrics.py, the bench keeping the largest of its measured steps, each
the largest over the ranks): on CUDA ``torch.cuda.max_memory_reserved``, the caching allocator's reserved peak; on a
CPU host the process's peak resident set (VmHWM, reset through /proc/self/clear_refs at each logged interval). A CPU
rank's resident set is mostly not the model's: the interpreter, torch's libraries and the pages of their code the run
touched, gloo's buffers, a per-process base of ~0.4 GiB on the bench host, beside 0.03-0.11 GiB of tensors for the
bench's debugmodel runs (plus what glibc keeps of freed memory).

The planner's peak is ``allocated x (1 + allocator_overhead) + framework_gib``: a proportional slack and a fixed
per-process part. Both are fitted (relative error, bounded >= 0) only when the runs identify both (their estimates
correlated within fit.MERGE_CORRELATION and each standard error below its value). Otherwise one is held at the
hardware's and the other fitted alone: the one the joint fit determines better (smaller relative standard error;
with fewer than three distinct sizes, the one that carries more of the hardware's own prediction). A one-node CPU
calibration spans too narrow a range of allocated sizes to tell a slack from a base: the slack
(``allocator_overhead``) stays at the ``cpu`` preset's 0 and the base (``framework_gib``) is fitted. Merging the
base into the slack instead, as fit.fit_memory does for the published GPU rows (whose peaks the slack dominates),
held the base at 0 and the slack at its bound and predicted a one-node CPU calibration's held-out runs 69-77 % low.

The reported spread (``memory_log_sd``) is the RMS log error of each run's peak predicted by the whole procedure
(choice included) run on the others: never the in-sample residual.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from meshforge.plan.accuracy.fit import MERGE_CORRELATION, MemoryFit, Observation, allocated_gib
from meshforge.plan.hardware import HardwareProfile

SLACK, FIXED = "allocator_overhead", "framework_gib"
UPPER = {SLACK: 2.0, FIXED: 100.0}
"""Bounds of the two constants (lower: 0), fit.py's."""


@dataclass(frozen=True)
class Terms:
    """Starting (the hardware's) values of the slack and the fixed part."""

    slack: float
    fixed: float

    def predict(self, allocated: float) -> float:
        return allocated * (1 + self.slack) + self.fixed


def solve(pairs: Sequence[tuple[float, float]], start: Terms, names: Sequence[str]) -> tuple[Terms, np.ndarray]:
    """Least squares on relative error of the constants ``names`` (the others held at ``start``): the fitted terms
    and the covariance of the fitted constants (residual variance x (J^T J)^-1)."""
    a = np.array([p[0] for p in pairs])
    m = np.array([p[1] for p in pairs])
    held = {SLACK: start.slack, FIXED: start.fixed}

    def terms(x: np.ndarray) -> Terms:
        values = held | dict(zip(names, (float(v) for v in x), strict=True))
        return Terms(values[SLACK], values[FIXED])

    def residuals(x: np.ndarray) -> np.ndarray:
        t = terms(x)
        return (a * (1 + t.slack) + t.fixed) / m - 1

    upper = np.array([UPPER[n] for n in names])
    # strictly inside the bounds: trf's scaling is |x - bound|, so a start on a bound never moves (fit.py's note)
    x0 = np.clip(np.array([held[n] for n in names], dtype=float), 0.01 * upper, 0.99 * upper)
    res = least_squares(residuals, x0, bounds=(np.zeros(len(names)), upper), method="trf")
    s2 = float(res.fun @ res.fun) / max(1, len(m) - len(names))
    return terms(res.x), s2 * np.linalg.pinv(res.jac.T @ res.jac)


def joint(pairs: Sequence[tuple[float, float]], start: Terms) -> tuple[Terms, np.ndarray, float]:
    """Both constants fitted together: the terms, their standard errors (slack, fixed), the estimates' correlation."""
    both, cov = solve(pairs, start, (SLACK, FIXED))
    se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    corr = float(cov[0, 1] / (se[0] * se[1])) if se[0] > 0 and se[1] > 0 else 0.0
    return both, se, corr


def choose(pairs: Sequence[tuple[float, float]], start: Terms) -> tuple[Terms, tuple[str, ...], str]:
    """The fitted terms, the constants fitted, and why the other is held (empty when both are fitted).

    Both when the runs identify both (estimates correlated within MERGE_CORRELATION, each standard error below its
    value). Else the better determined of the two in the joint fit (smaller relative standard error), the other held
    at the hardware's; with fewer than three distinct allocated sizes (no joint fit), the term that carries more of
    the hardware's own prediction of the runs."""
    sizes = [p[0] for p in pairs]
    if len({round(a, 3) for a in sizes}) < 3:
        name = SLACK if sum(sizes) / len(sizes) * start.slack > start.fixed else FIXED
        why = "fewer than three distinct allocated sizes"
    else:
        both, se, corr = joint(pairs, start)
        rel = {SLACK: _relative(se[0], both.slack), FIXED: _relative(se[1], both.fixed)}
        if abs(corr) <= MERGE_CORRELATION and max(rel.values()) < 1:
            return both, (SLACK, FIXED), ""
        name = min(rel, key=lambda n: rel[n])
        why = f"estimates correlated {corr:+.2f}; relative standard errors {SLACK} {rel[SLACK]:.2f}, "
        why += f"{FIXED} {rel[FIXED]:.2f}"
    other = SLACK if name == FIXED else FIXED
    value = start.slack if other == SLACK else start.fixed
    reason = f"{other} held at the hardware's {value:g}: the runs cannot identify both ({why}); {name} fitted alone"
    return solve(pairs, start, (name,))[0], (name,), reason


def _relative(se: float, value: float) -> float:
    return se / value if value > 0 else math.inf


def fit_memory_terms(pairs: Sequence[tuple[float, float]], hw: HardwareProfile) -> MemoryFit:
    """The memory constants fitted to (allocated, measured) pairs from ``hw``'s, with their standard errors, the
    leave-one-out spread of the whole procedure, and what is held and why."""
    eff = hw.efficiency
    start = Terms(eff.allocator_overhead, eff.framework_gib)
    terms, names, reason = choose(pairs, start)
    cov = solve(pairs, start, names)[1] if len(pairs) > len(names) else np.zeros((len(names), len(names)))
    se = dict(zip(names, np.sqrt(np.clip(np.diag(cov), 0.0, None)).tolist(), strict=True))
    return MemoryFit(terms.slack, terms.fixed, (se.get(SLACK, 0.0), se.get(FIXED, 0.0)), spread(pairs, hw), reason)


def held_out_errors(pairs: Sequence[tuple[float, float]], hw: HardwareProfile) -> list[float]:
    """Each run's relative error, predicted by the whole procedure (the choice of constants included) on the others."""
    eff = hw.efficiency
    start = Terms(eff.allocator_overhead, eff.framework_gib)
    out = []
    for i, (a, m) in enumerate(pairs):
        terms = choose([p for j, p in enumerate(pairs) if j != i], start)[0]
        out.append(terms.predict(a) / m - 1)
    return out


def spread(pairs: Sequence[tuple[float, float]], hw: HardwareProfile) -> float:
    """The memory interval's +-1 sd: RMS log error over held_out_errors (the hardware's with fewer than 2 runs)."""
    if len(pairs) < 2:
        return hw.efficiency.memory_log_sd
    errors = held_out_errors(pairs, hw)
    return math.sqrt(sum(math.log(1 + e) ** 2 for e in errors) / len(errors))


def describe(mem: MemoryFit | None, start: HardwareProfile, fitted: HardwareProfile, obs: Sequence[Observation]) -> str:
    """Lines for --calibrate (after a blank one; "" without a memory fit): each memory constant fitted from
    ``start``'s (with its standard error) or held (and why), and each run's peak predicted by the procedure fitted to
    the other runs (its accuracy; the in-sample "within 25 %" count is not)."""
    if mem is None:
        return ""
    eff, lines = start.efficiency, [""]
    pairs = [(allocated_gib(o, fitted), o.peak_memory_gib) for o in obs if o.peak_memory_gib]
    for name, before, after, se in (
        (SLACK, eff.allocator_overhead, mem.allocator_overhead, mem.stderr[0]),
        (FIXED, eff.framework_gib, mem.framework_gib, mem.stderr[1]),
    ):
        if se == 0 and after == before and mem.merged:
            lines.append(f"memory: {mem.merged}")
        else:
            lines.append(f"memory: fitted {name}: {before:.4g} -> {after:.4g} (standard error {se:.2g})")
    if len(pairs) >= 2:
        errors = held_out_errors(pairs, start)
        lines.append(
            f"memory, each run predicted by the fit to the others (leave-one-out): max |error| "
            f"{max(abs(e) for e in errors):.1%}, within 25 % {sum(abs(e) <= 0.25 for e in errors)} of {len(errors)}, "
            f"RMS log {mem.residual_sd:.3f} (the interval's +-1 sd)"
        )
    return "\n".join(lines) + "\n"
