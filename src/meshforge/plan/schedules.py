"""Pipeline schedules in closed form: idle (bubble) time and microbatches in flight. Pure Python.

p = pipeline ranks, m = microbatches per step, v = stages per rank. Bubble ratios are idle time over busy time:
GPipe / 1F1B (p-1)/m (Huang 2019, Narayanan 2019); interleaved 1F1B and looped BFS (p-1)/(v m) (Narayanan 2021);
zero-bubble schedules split the backward into input- and weight-gradient halves and fill about two thirds of the
1F1B bubble (Qi 2023, ZB-H1/ZB-V), so (p-1)/(v m)/3.
"""

from __future__ import annotations

from meshforge.plan.layout import Layout

ZERO_BUBBLE_REMAINDER = 1 / 3
"""Fraction of the interleaved bubble zero-bubble schedules leave (Qi et al. 2023, ZB-H1: about 1/3)."""


def bubble_ratio(layout: Layout) -> float:
    """Idle time of a pipeline rank over its busy time in one step (0 without pipeline parallel)."""
    p, m, v = layout.pp, layout.num_microbatches, layout.stages_per_rank
    if p == 1:
        return 0.0
    if layout.schedule in ("GPipe", "1F1B"):
        return (p - 1) / m
    ratio = (p - 1) / (v * m)
    if layout.schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        ratio *= ZERO_BUBBLE_REMAINDER
    return ratio


def in_flight(layout: Layout, rank: int) -> int:
    """Stage-microbatches whose activations a pipeline rank holds at its peak (forwards not yet backwarded)."""
    p, m, v = layout.pp, layout.num_microbatches, layout.stages_per_rank
    if p == 1:
        return 1
    total = v * m
    if layout.schedule in ("GPipe", "LoopedBFS"):
        return total
    if layout.schedule == "1F1B":
        return min(m, p - rank)
    if layout.schedule in ("ZBVZeroBubble", "DualPipeV"):
        # ZB-V holds the same activation memory as 1F1B: p microbatches through the rank's layers (2p half-stages)
        return min(total, 2 * (p - rank))
    # Interleaved1F1B / InterleavedZeroBubble warm-up (torch.distributed.pipelining): (v-1) p + 2 (p-1-rank), +1 steady
    return min(total, (v - 1) * p + 2 * (p - 1 - rank) + 1)
