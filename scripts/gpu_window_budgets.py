"""The second GPU window's time boxes (scripts/gpu_window.py), each from a measured time or marked an estimate.

Measured bases (the first window, one H200, torch 2.11.0+cu130, cold caches, docs/benchmarks/gpu/run{1,3}-results.json):
a one-process debugmodel / debugmoe run took 9.2-11.9 s wall (start-up dominated), Llama 3.2 1B at seq 8192 x 2 with
selective AC 11.1 s for 3 eager steps and 21.9 s for 8 compiled steps (cold inductor compile included). Local-rank
runs were measured on this CPU only (scripts/local_ranks_check.py MEASURED_CPU_S: 1.1-1.6 x their one-process
reference under load). A box is twice the measured (or estimated) wall time, as in scripts/gpu_check_budgets.py.
"""

from __future__ import annotations

import math

TOTAL_S = 480
"""The boxes kept must sum to this or less: a 600 s call holds a cold start (~100-135 s) and these."""
MEASURED_H200_S = {"dense_ref": 11.9, "moe_ref": 9.2, "mfu_1b_eager": 11.1, "mfu_1b": 21.9, "env": 6.3}
"""Wall seconds on the H200 (first window's runs 1 and 3)."""
LOCAL_OVER_REF = 1.6
"""A local-rank run over its one-process reference, wall time: the largest ratio measured on the CPU (TP 2: 35.2 s
against 21.9 s); assumed to hold on a GPU (the per-op Python dispatch of each simulated rank dominates there too)."""
ESTIMATED_S = {
    "lr_ref": 10.0,  # 2 layers, seq 64, 2 steps: fewer steps and layers than dense_ref's 11.9 s (start-up dominated)
    "mem_1b_none": 10.0,  # no recomputation: a little less than selective's 11.1 s
    "mem_1b_full": 13.0,  # full recomputation: ~1/3 more compute per step than selective
    "mem_3b": 25.0,  # 3.2B parameters to build and initialise, ~2.6x the 1B's compute per step
    "bench_first": 46.0,  # bf16 compile (21.9 s measured) + two Float8 graphs (~1.5x its compile each, unmeasured)
    "bench_rest": 60.0,  # eager (~14 s), compiled AC full (~22 s) and AC none at batch 1 (~20 s), report + plots
    "offload": 15.0,  # mem_1b_selective with activation offload: its 11.1 s plus the host copies
}
"""Estimates (nothing of these has run on a GPU): the comment says from what."""


def box(seconds: float) -> int:
    """Twice the expected wall time, rounded up to a second."""
    return math.ceil(2 * seconds)


BUDGETS = {
    "env": box(MEASURED_H200_S["env"]),
    "lr_dense_ref": box(ESTIMATED_S["lr_ref"]),
    "lr_tp2": box(LOCAL_OVER_REF * ESTIMATED_S["lr_ref"]),
    "lr_cp2": box(LOCAL_OVER_REF * ESTIMATED_S["lr_ref"]),
    "lr_fsdp2": box(LOCAL_OVER_REF * ESTIMATED_S["lr_ref"]),
    "lr_moe_ref": box(ESTIMATED_S["lr_ref"]),
    "lr_ep2": box(LOCAL_OVER_REF * ESTIMATED_S["lr_ref"]),
    "mem_1b_selective": box(MEASURED_H200_S["mfu_1b_eager"]),
    "mem_1b_none": box(ESTIMATED_S["mem_1b_none"]),
    "mem_1b_full": box(ESTIMATED_S["mem_1b_full"]),
    "float8_1b": box(ESTIMATED_S["bench_first"]),
    "peer_torchtitan": 0,
    "bench_gpu1": box(ESTIMATED_S["bench_rest"]),
    "mem_3b_selective": box(ESTIMATED_S["mem_3b"]),
    "mem_3b_full": box(ESTIMATED_S["mem_3b"]),
    "offload_1b": box(ESTIMATED_S["offload"]),
    "regather_auto": 0,
}
"""Seconds per check, in the plan's order of value."""
MEASURED = {"env", "mem_1b_selective"}
"""The checks whose box comes from a time measured on the H200 (the rest are estimates: ``ESTIMATED_S``)."""
