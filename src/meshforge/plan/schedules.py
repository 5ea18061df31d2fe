"""Pipeline schedules in closed form: idle (bubble) time and microbatches in flight. Pure Python.

The step time comes from simulating the schedule (simulator.py), which reproduces these bubbles when sends are free
and m is a multiple of p; the closed forms remain the reference it is tested against, and in_flight sizes the
activation memory.

p = pipeline ranks, m = microbatches per step, v = stages per rank. Bubble ratios are idle time over busy time:
GPipe / 1F1B (p-1)/m (Huang 2019, Narayanan 2019); interleaved 1F1B and looped BFS (p-1)/(v m) (Narayanan 2021);
zero-bubble schedules split the backward into input- and weight-gradient halves and fill about two thirds of the
1F1B bubble (Qi 2023, ZB-H1/ZB-V), so (p-1)/(v m)/3.
"""

from __future__ import annotations

from meshforge.parallel.pipeline import simulator
from meshforge.plan.layout import Layout

ZERO_BUBBLE_REMAINDER = 1 / 3
"""Fraction of the interleaved bubble zero-bubble schedules leave (Qi et al. 2023, ZB-H1: about 1/3)."""


def bubble_ratio(layout: Layout) -> float:
    """Idle time of a pipeline rank over its busy time in one step (0 without pipeline parallel)."""
    p, m, v = layout.pp, layout.schedule_microbatches, layout.stages_per_rank
    if p == 1:
        return 0.0
    if layout.schedule in ("GPipe", "1F1B"):
        return (p - 1) / m
    ratio = (p - 1) / (v * m)
    if layout.schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        ratio *= ZERO_BUBBLE_REMAINDER
    return ratio


def in_flight(layout: Layout, rank: int) -> int:
    """Stage-microbatches whose activations a pipeline rank holds at its peak, counted in the schedule's own order
    (simulator.in_flight). What that gives, for m a multiple of p: 1F1B p - rank; GPipe and looped BFS v m;
    interleaved 1F1B (v-1) p + 2 (p-1-rank) + 1; interleaved zero bubble v p on every rank (a warm-up one shorter per
    hop, weight gradients one later per hop); ZB-V 2 p on every rank once m >= 2p - 1."""
    return in_flight_fast(layout, rank)


EXTRAPOLATE_ROUNDS = 3
"""Schedules of more than this many rounds of p microbatches are simulated at this many rounds and one more, and
extended linearly: past the warm-up every round repeats the same actions, so the step grows by the same time per round
(the peak of activations in flight is reached in the warm-up, so it is the same too, or, for the schedules that run
every forward first, grows by one round's forwards). tests/unit/test_plan_speed.py
checks both against the full simulation."""


def _short(layout: Layout, rounds: int) -> simulator.Shape:
    return simulator.Shape(layout.schedule, layout.pp, rounds * layout.pp, layout.stages_per_rank)


def _long(layout: Layout) -> bool:
    m, p = layout.schedule_microbatches, layout.pp
    return m % p == 0 and m // p > EXTRAPOLATE_ROUNDS + 1


def in_flight_fast(layout: Layout, rank: int) -> int:
    """``in_flight``, counted on short schedules of the same shape and extended when the real one is long."""
    if layout.pp == 1:
        return 1
    if not _long(layout):
        return simulator.in_flight(layout, rank)
    k = EXTRAPOLATE_ROUNDS
    a = simulator.in_flight(_short(layout, k), rank)
    b = simulator.in_flight(_short(layout, k + 1), rank)
    return b + (layout.schedule_microbatches // layout.pp - (k + 1)) * (b - a)


def simulate(
    layout: Layout, costs: list[simulator.StageCost], latency: float, overhead: float = 0.0
) -> simulator.StepResult:
    """simulator.simulate, extended linearly from EXTRAPOLATE_ROUNDS and one more rounds for long schedules."""
    if not _long(layout):
        return simulator.simulate(layout, costs, latency, overhead)
    k = EXTRAPOLATE_ROUNDS
    a = simulator.simulate(_short(layout, k), costs, latency, overhead)
    b = simulator.simulate(_short(layout, k + 1), costs, latency, overhead)
    extra = layout.schedule_microbatches // layout.pp - (k + 1)

    def ext(x: float, y: float) -> float:
        return y + extra * (y - x)

    busy = tuple(ext(x, y) for x, y in zip(a.rank_busy, b.rank_busy, strict=True))
    return simulator.StepResult(ext(a.makespan, b.makespan), busy, ext(a.exposed_sends, b.exposed_sends))
