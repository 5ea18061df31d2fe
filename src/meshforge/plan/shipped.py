"""The shipped GPU constants: the fit of plan/validate.py to every published row, from its neutral start (rounded).

Kept apart from hardware.py so that refitting them changes no file the leave-one-out folds depend on (the folds start
from validate.NEUTRAL, never from these; plan/folds.py's key hashes hardware.py's code). The test
tests/unit/test_plan_validate.py fails when they are not the fit. ``REFERENCE`` is the h100-96gb family's (the
shared constants: 29 of the 35 rows); ``FAMILIES`` holds, per GPU generation the rows determine, its speed factor on
matmul and attention (fit.FAMILY_SCALES) and its own leave-one-out spreads; ``UNSEEN`` is a generation with no row:
the shared constants with the family prior's spread added (validate.FAMILY_PRIOR_SD).
"""

from __future__ import annotations

REFERENCE: dict[str, float] = {
    "matmul": 0.548,
    "attention": 0.2204,
    "float8_speedup": 1.5975,
    "memory_bandwidth": 0.9134,
    "network": 0.8817,
    "async_tp_overlap": 0.5,  # not identified by the rows (log standard error > 1): held at the neutral start
    "allocator_overhead": 0.0,  # at its bound: the rows' memory errors (+35 % H200, -20 % 70B / 405B) cancel
    "framework_gib": 0.0,
    "tps_log_sd": 0.0895,
    "memory_log_sd": 0.1875,
}
FAMILIES: dict[str, dict[str, float]] = {
    "a100": {"factor": 1.4516, "tps_log_sd": 0.1817, "memory_log_sd": 0.2076},
    "h100": {"factor": 0.8478, "tps_log_sd": 0.0889, "memory_log_sd": 0.2076},
    "h200": {"factor": 1.2315, "tps_log_sd": 0.0889, "memory_log_sd": 0.3021},
}
"""name -> its speed factor and spreads (two rows each: at least the pooled spreads, loo_report.MIN_FAMILY_ROWS)."""
UNSEEN_PRESETS = ("gb200",)
"""GPU presets no published row measured."""
UNSEEN: dict[str, float] = {"tps_log_sd": 0.2655, "memory_log_sd": 0.3125}
"""The spreads of a GPU generation no row measured: the reference's with validate.FAMILY_PRIOR_SD added."""
COVARIANCE_NAMES: tuple[str, ...] = (
    "matmul",
    "attention",
    "float8_speedup",
    "memory_bandwidth",
    "network",
    "family:a100",
    "family:h100",
    "family:h200",
)
COVARIANCE: tuple[tuple[float, ...], ...] = (
    (0.0071, 0.0, -0.0043, -0.0213, -0.0046, 0.0037, -0.0015, 0.0007),
    (0.0, 0.0033, -0.001, -0.006, -0.0003, 0.0004, -0.0002, -0.0),
    (-0.0043, -0.001, 0.0059, 0.01, 0.0005, 0.0007, 0.0006, -0.0011),
    (-0.0213, -0.006, 0.01, 0.142, 0.0032, -0.0043, 0.0004, -0.0034),
    (-0.0046, -0.0003, 0.0005, 0.0032, 0.0223, -0.0232, 0.0023, -0.0016),
    (0.0037, 0.0004, 0.0007, -0.0043, -0.0232, 0.055, -0.0019, 0.0018),
    (-0.0015, -0.0002, 0.0006, 0.0004, 0.0023, -0.0019, 0.0067, 0.0002),
    (0.0007, -0.0, -0.0011, -0.0034, -0.0016, 0.0018, 0.0002, 0.0086),
)
"""Covariance of the log-multipliers of the fit to every row (the dropped async_tp_overlap left out)."""
DIFF_LOG_SD = 0.1266
"""Spread of a predicted ratio of two layouts of one source and family (loo_report.difference_spread)."""
