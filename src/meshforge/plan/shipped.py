"""The shipped GPU constants: the fit of plan/accuracy/loo.py to every published row, from its neutral start (rounded).

Kept apart from hardware.py so that refitting them changes no file the leave-one-out folds depend on (the folds start
from loo.NEUTRAL, never from these; plan/accuracy/folds.py's key hashes hardware.py's code). The test
tests/unit/test_plan_validate.py fails when they are not the fit. ``REFERENCE`` is the h100-96gb family's (the
shared constants: 29 of the 37 rows); ``FAMILIES`` holds, per GPU generation the rows determine, its speed factor on
matmul and attention (fit.FAMILY_SCALES) and its spreads (memory: its rows' leave-one-out; tokens/s: at least a new
source's, SOURCE_LOG_SD); ``UNSEEN`` is a generation with no row:
the shared constants with the family prior's spread added (loo.FAMILY_PRIOR_SD).
"""

from __future__ import annotations

REFERENCE: dict[str, float] = {
    "matmul": 0.541,
    "attention": 0.2196,
    "float8_speedup": 1.5984,
    "memory_bandwidth": 0.9482,
    "network": 0.8883,
    "async_tp_overlap": 0.5,  # not identified by the rows (log standard error > 1): held at the neutral start
    "allocator_overhead": 0.1945,  # allocator rounding, CUDA context, NCCL over physics/peak.py's exact-checked terms
    "framework_gib": 0.0,  # merged into allocator_overhead (estimates correlated -0.97)
    "tps_log_sd": 0.2929,  # SOURCE_LOG_SD: a new source's spread (its own LOO quantile was 0.0879)
    "memory_log_sd": 0.0671,
}
FAMILIES: dict[str, dict[str, float]] = {
    "a100": {"factor": 1.4606, "tps_log_sd": 0.2929, "memory_log_sd": 0.0672},
    "b200": {"factor": 0.5087, "tps_log_sd": 0.2929, "memory_log_sd": 0.1613},
    "h100": {"factor": 0.8526, "tps_log_sd": 0.2929, "memory_log_sd": 0.0672},
    "h200": {"factor": 1.2366, "tps_log_sd": 0.2929, "memory_log_sd": 0.0672},
}
"""name -> its speed factor and spreads (two rows each: at least the pooled spreads, loo_report.MIN_FAMILY_ROWS); the
tokens/s spread at least SOURCE_LOG_SD (a user's stack is a source the fit never saw)."""
UNSEEN_PRESETS = ("gb200",)
"""GPU presets no published row measured."""
UNSEEN: dict[str, float] = {"tps_log_sd": 0.3851, "memory_log_sd": 0.2589}
"""The spreads of a GPU generation no row measured: the reference's with loo.FAMILY_PRIOR_SD added."""
COVARIANCE_NAMES: tuple[str, ...] = (
    "matmul",
    "attention",
    "float8_speedup",
    "memory_bandwidth",
    "network",
    "family:a100",
    "family:b200",
    "family:h100",
    "family:h200",
)
COVARIANCE: tuple[tuple[float, ...], ...] = (
    (0.0065, -0.0, -0.0036, -0.0204, -0.005, 0.0038, -0.0022, -0.0014, 0.0006),
    (-0.0, 0.0033, -0.001, -0.006, -0.0003, 0.0004, -0.0004, -0.0002, -0.0),
    (-0.0036, -0.001, 0.0052, 0.0088, 0.0003, 0.0008, 0.0008, 0.0005, -0.001),
    (-0.0204, -0.006, 0.0088, 0.148, 0.0031, -0.0041, 0.0053, 0.0001, -0.0032),
    (-0.005, -0.0003, 0.0003, 0.0031, 0.0259, -0.0252, 0.0028, 0.0025, -0.0016),
    (0.0038, 0.0004, 0.0008, -0.0041, -0.0252, 0.0522, -0.0023, -0.002, 0.0017),
    (-0.0022, -0.0004, 0.0008, 0.0053, 0.0028, -0.0023, 0.0065, 0.0008, 0.0001),
    (-0.0014, -0.0002, 0.0005, 0.0001, 0.0025, -0.002, 0.0008, 0.0066, 0.0002),
    (0.0006, -0.0, -0.001, -0.0032, -0.0016, 0.0017, 0.0001, 0.0002, 0.0083),
)
"""Covariance of the log-multipliers of the fit to every row (the dropped async_tp_overlap left out)."""
DIFF_LOG_SD = 0.1261
"""Spread of a predicted ratio of two layouts of one source and family (loo_report.difference_spread)."""

STACKS: dict[str, dict[str, object]] = {
    "torchtitan-h100": {
        "hardware": "h100",
        "efficiency": {},
        "fitted": ("matmul", "attention", "float8_speedup", "memory_bandwidth", "network"),
        "held": ("async_tp_overlap",),
        "world_sizes": (8, 512),
        "sources": ("every published row (plan/accuracy/published.py): the h100 family of the shipped fit",),
    },
    "nemo-h100-bf16": {
        "hardware": "h100",
        "efficiency": {"matmul": 0.7497, "attention": 0.3043, "tps_log_sd": 0.2929},
        "fitted": ("compute",),
        "held": ("float8_speedup", "memory_bandwidth", "network", "async_tp_overlap"),
        "world_sizes": (8,),
        "sources": ("NVIDIA/dgxc-benchmarking 35a9aecc llama3.1/README_8b.md: 8B BF16, 8 x H100, 12.91 s/step",),
    },
    "nemo-h100-fp8": {
        "hardware": "h100",
        "efficiency": {"matmul": 0.7499, "attention": 0.3044, "float8_speedup": 1.7798, "tps_log_sd": 0.2929},
        "fitted": ("compute", "float8_speedup"),
        "held": ("memory_bandwidth", "network", "async_tp_overlap"),
        "world_sizes": (8,),
        "sources": (
            "NVIDIA/dgxc-benchmarking 35a9aecc llama3.1/README_8b.md: 8B BF16, 8 x H100, 12.91 s/step (compute)",
            "the same README: 8B FP8, 8 x H100, 9.67 s/step (float8_speedup)",
        ),
    },
}
"""Stack profiles (plan/accuracy/stack.py): an implementation's constants on a preset's datasheet. ``efficiency``
overrides the preset's family constants (fitted by plan/accuracy/stack_fit.py, which a test reruns); ``fitted`` is
what the runs determined (``compute``: one factor on matmul and attention), ``held`` what stays at the preset's,
``world_sizes`` the runs' range (one node's runs: every inter-node constant is held)."""
SPLIT_LOG_SD = 0.2771
"""Spread of a stack profile fitted on one node predicting more: the NOMINAL quantile of |log error| of TorchTitan's
multi-node rows predicted by its 8-GPU rows' calibration (plan/accuracy/at_scale.py; a test recomputes it)."""
SOURCE_LOG_SD = 0.2929
"""The tokens/s spread of a source the fit never saw (a user's own stack on a preset): the 68.3 % quantile of |log
error| of every published row's leave-one-source-out prediction (loo_report.shipped_values; a test recomputes it).
Shipped as every fitted family's tokens/s spread: the rows' own leave-one-out quantile (0.0879 on the reference)
covered 11 of 37 rows of a left-out source (30 %)."""
SOURCE_COVERAGE = 0.5946
"""SOURCE_LOG_SD's coverage measured nested: each source's leave-one-source-out errors against the 68.3 % quantile of
the other sources' (loo_report.source_coverage): 22 of 37 rows, 7 sources."""
