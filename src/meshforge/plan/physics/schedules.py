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

import functools

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


EXTRAPOLATE_ROUNDS = 2
"""Rounds the first short simulation has (then doubled until steady).
Long schedules (rounds of p microbatches beyond this + 1) are simulated short and extended linearly: past the
warm-up every round repeats the same actions, so the step grows by the same time per round (checked: the extension is
used only once three consecutive lengths agree) and the peak of activations in flight is reached in the warm-up (or,
for the schedules that run every forward first, grows by one round's forwards). tests/unit/test_plan_speed.py checks
both against the full simulation, and the search's results against a search without the shortcut."""


IN_FLIGHT_ROUNDS = 3
"""Rounds of the short schedules activations in flight are counted on (cheap: counted once per schedule shape)."""


def _short(layout: Layout | simulator.Shape, rounds: int) -> simulator.Shape:
    return simulator.Shape(layout.schedule, layout.pp, rounds * layout.pp, layout.stages_per_rank)


def _long(layout: Layout | simulator.Shape) -> bool:
    m, p = layout.schedule_microbatches, layout.pp
    return m % p == 0 and m // p > IN_FLIGHT_ROUNDS + 1


def in_flight_fast(layout: Layout, rank: int) -> int:
    """``in_flight``, counted on short schedules of the same shape and extended when the real one is long."""
    if layout.pp == 1:
        return 1
    if not _long(layout):
        return simulator.in_flight(layout, rank)
    k = IN_FLIGHT_ROUNDS
    a = simulator.in_flight(_short(layout, k), rank)
    b = simulator.in_flight(_short(layout, k + 1), rank)
    return b + (layout.schedule_microbatches // layout.pp - (k + 1)) * (b - a)


def simulate(
    layout: Layout, costs: list[simulator.StageCost], latency: float, overhead: float = 0.0
) -> simulator.StepResult:
    """simulator.simulate, extended linearly for long schedules once short simulations of k and k + 1 rounds are in
    steady state: the step grows per round by exactly its busiest rank's work (bound by it), or, where sends bound
    it instead, by the same time over three consecutive lengths; k doubles until then, and a schedule too short to
    tell is simulated in full.

    Memoized on everything the result depends on (the schedule shape, the exact stage costs, latency and overhead,
    and EXTRAPOLATE_ROUNDS): a search meets the same simulation for every data-parallel split of a structure and for
    every GPU count whose global batch gives the same local batch, so cells of one model and sequence length share
    them (plan/guide/guide.py runs those cells in one process). No normalisation: a hit returns the very floats a fresh
    simulation would, so results stay bit-identical."""
    shape = simulator.Shape(layout.schedule, layout.pp, layout.schedule_microbatches, layout.stages_per_rank)
    return _simulate(shape, tuple(costs), latency, overhead, EXTRAPOLATE_ROUNDS)


@functools.lru_cache(maxsize=1 << 16)
def _simulate(
    shape: simulator.Shape, costs: tuple[simulator.StageCost, ...], latency: float, overhead: float, k: int
) -> simulator.StepResult:
    rounds = shape.schedule_microbatches // shape.pp
    while _long(shape) and k + 2 < rounds:
        a, b = (simulator.simulate(_short(shape, r), costs, latency, overhead) for r in (k, k + 1))
        growth = b.makespan - a.makespan
        bottleneck = max(y - x for x, y in zip(a.rank_busy, b.rank_busy, strict=True))
        if abs(growth - bottleneck) <= 1e-9 * b.makespan:
            return _extend(a, b, rounds - (k + 1))
        c = simulator.simulate(_short(shape, k + 2), costs, latency, overhead)
        if growth > bottleneck and abs((c.makespan - b.makespan) - growth) <= 1e-9 * c.makespan:
            return _extend(b, c, rounds - (k + 2))
        k *= 2
    return simulator.simulate(shape, costs, latency, overhead)


def _extend(b: simulator.StepResult, c: simulator.StepResult, extra: int) -> simulator.StepResult:
    """c plus ``extra`` more rounds at the growth from b to c. The sends on the critical path depend on which of
    tied paths is followed, so they are only kept within the step's idle time."""

    def ext(x: float, y: float) -> float:
        return y + extra * (y - x)

    busy = tuple(ext(x, y) for x, y in zip(b.rank_busy, c.rank_busy, strict=True))
    makespan = ext(b.makespan, c.makespan)
    sends = min(max(0.0, ext(b.exposed_sends, c.exposed_sends)), makespan - max(busy))
    return simulator.StepResult(makespan, busy, max(0.0, sends))
