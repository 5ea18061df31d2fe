"""The GPU check's time boxes, from measurements (docs/benchmarks/gpu-check-budgets.md), and what does not fit.

A compiled check's box is its start-up, its cold inductor compile (forward + backward) and its steps. The compile
was measured on a CPU (scripts/gpu_check_compile.py: the same blocks, AC and compile as ``meshforge train``, an
empty inductor cache), a floor for the GPU's: inductor's Triton path adds PTX / cubin compilation per kernel, which
``DEVICE_COMPILE_FACTOR`` covers (assumed, not measured: no GPU has run this project yet). The boxes of the other
checks are start-up plus their work (no compile). The sum of the checks that run stays <= ``TOTAL_S``: checks are
kept in the plan's order (its order of value: the multi-rank unknowns, then correctness, then speed) while they fit;
the rest are dropped and named in the results (``fit``).
"""

from __future__ import annotations

import math

TOTAL_S = 480
"""The checks' share of a 15-minute device allowance: a cold machine took ~100-135 s to start on 2026-12-04 (H200),
and a second run must still fit after a first one."""
MEASURED_H200_S = {"dense_compile": 20.0, "mfu_1b_eager": 11.1, "mfu_1b": 21.9}
"""Wall seconds of the compiled checks (and the 1B's eager reference) on the H200, cold inductor cache, torch
2.11.0+cu130, 2026-12-04 (docs/benchmarks/gpu/README.md): the boxes below are twice these."""
COMPILE_CPU_S = {"debugmodel": 43.1, "1B": 59.1}
"""Cold inductor compile, forward + backward, measured on AMD EPYC (2 shared cores, 1 compile thread, torch 2.13.0
CPU), 2026-12-04: debugmodel (fp32, seq 512, batch 8, selective AC) 21.6 s with 6 blocks and 43.1 s with 2 (the
same compiled graph; the spread is the shared machine's load: the larger is kept); Llama 3.2 1B's block (bf16
autocast, selective AC, seq 256 x 1: the block graph is the same at seq 8192, static shapes) 59.1 s."""
DEVICE_COMPILE_FACTOR = 1.5
"""GPU compile / CPU compile, assumed: Triton kernels also go through ptxas (about 1 s per kernel, partly in
parallel over the GPU host's cores); the CPU figure is the floor."""
START_S = 15
"""Per process: imports, CUDA context, model build and initialisation, the first batch."""


def compile_box(graph: str, run_s: int) -> int:
    """Start-up + the device's cold compile + ``run_s`` of steps."""
    return START_S + math.ceil(DEVICE_COMPILE_FACTOR * COMPILE_CPU_S[graph]) + run_s


BUDGETS = {
    "env": 15,
    "nccl_2_ranks": 25,
    "gloo_cuda_2_ranks": 25,
    "gloo_cuda_funcol": 20,
    "cp_attention": 50,
    "dense_ref": 25,
    "dense_compile": 2 * math.ceil(MEASURED_H200_S["dense_compile"]),  # was compile_box: 90 s from the CPU
    "dense_fsdp2": 35,
    "dense_tp2": 35,
    "moe_ref": 25,
    "moe_ep2": 35,
    "mfu_1b_eager": 2 * math.ceil(MEASURED_H200_S["mfu_1b_eager"]),  # 1B at seq 8192: build + init, 3 eager steps
    "mfu_1b": 2 * math.ceil(MEASURED_H200_S["mfu_1b"]),  # was compile_box: 124 s from the CPU
    "mfu_1b_float8": 3 * math.ceil(MEASURED_H200_S["mfu_1b"]),  # not yet run on a GPU: 3 x the bf16 graph's
}
"""Seconds per check."""
TOGETHER = {"mfu_1b_eager": "mfu_1b"}
"""A reference that serves one check only: kept or dropped with it."""


def fit(boxes: dict[str, int], total_s: float = TOTAL_S) -> tuple[list[str], list[str]]:
    """(kept, dropped) among ``boxes`` (check -> seconds, in the plan's order: value first): each check, with its
    ``TOGETHER`` partner, is kept when it still fits in ``total_s`` on top of those kept before it."""
    names = list(boxes)
    kept: list[str] = []
    dropped: list[str] = []
    used = 0.0
    for name in names:
        if name in kept or name in dropped:
            continue
        group = [name] + [n for n, partner in TOGETHER.items() if partner == name and n in boxes]
        group += [TOGETHER[name]] if TOGETHER.get(name) in boxes else []
        cost = sum(boxes[n] for n in group)
        fits = used + cost <= total_s
        (kept if fits else dropped).extend(group)
        used += cost if fits else 0
    order = {n: i for i, n in enumerate(names)}
    return sorted(kept, key=order.__getitem__), sorted(dropped, key=order.__getitem__)
