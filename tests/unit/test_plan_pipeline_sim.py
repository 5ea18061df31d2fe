"""The planner's pipeline simulation: torch's schedule orders, the closed-form bubbles, and what sends cost."""

from __future__ import annotations

import warnings

import pytest

from meshforge.plan import schedules
from meshforge.plan.layout import Layout
from meshforge.plan.pipeline_sim import StageCost, rank_order, simulate, spell

pytestmark = pytest.mark.filterwarnings("ignore")

MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


def layout(schedule: str, p: int, m: int, v: int = 1) -> Layout:
    return Layout(flavor="debugmodel", seq_len=128, local_batch_size=m, pp=p, schedule=schedule, stages_per_rank=v)


def uniform(lay: Layout, forward: float = 1.0, backward: float = 2.0) -> list[StageCost]:
    return [StageCost(forward, backward)] * lay.num_stages


def shapes() -> list[tuple[str, int, int, int]]:
    out = [("GPipe", p, m, 1) for p in (2, 4) for m in (p, 2 * p, p + 1)]
    out += [(s, p, m, v) for s in MULTI for p in (2, 4) for m in (p, 2 * p, 3 * p) for v in (2, 3)]
    out += [("ZBVZeroBubble", p, m, 2) for p in (2, 4) for m in (p, 2 * p - 1, 3 * p)]
    return out


@pytest.mark.parametrize(("schedule", "p", "m", "v"), shapes())
def test_orders_are_torchs(schedule: str, p: int, m: int, v: int) -> None:
    """Every rank's actions, weight-gradient halves included, in torch.distributed.pipelining's order."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _ComputationType as C

    kinds = (C.FORWARD, C.FULL_BACKWARD, C.BACKWARD_INPUT, C.BACKWARD_WEIGHT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = get_schedule_ops(schedule, p, m, v if v > 1 else None)
    lay = layout(schedule, p, m, v)
    for rank in range(p):
        theirs = [str(a) for a in ops[rank] if a is not None and a.computation_type in kinds]
        ours = [spell(a) for a in rank_order(lay, rank)]
        assert ours == theirs, rank


def test_1f1b_order() -> None:
    """torch's visualizer mislabels 1F1B's last rank (its mock stage), so 1F1B is spelt out: p - 1 - rank warm-up
    forwards, then a forward and a backward in turn."""
    lay = layout("1F1B", 4, 6)
    spelt = [[spell(a) for a in rank_order(lay, r)] for r in (0, 3)]
    assert spelt[0][:5] == ["0F0", "0F1", "0F2", "0F3", "0B0"]
    assert spelt[1][:4] == ["3F0", "3B0", "3F1", "3B1"]


CLOSED_FORM = [
    ("GPipe", 4, 8, 1),
    ("1F1B", 4, 8, 1),
    ("1F1B", 8, 16, 1),
    ("Interleaved1F1B", 4, 8, 2),
    ("Interleaved1F1B", 8, 16, 4),
    ("LoopedBFS", 4, 8, 2),
    ("InterleavedZeroBubble", 4, 8, 2),
    ("ZBVZeroBubble", 4, 8, 2),
    ("ZBVZeroBubble", 8, 16, 2),
]


@pytest.mark.parametrize(("schedule", "p", "m", "v"), CLOSED_FORM)
def test_free_sends_give_the_closed_form_bubble(schedule: str, p: int, m: int, v: int) -> None:
    lay = layout(schedule, p, m, v)
    result = simulate(lay, uniform(lay, 1.0 / v, 2.0 / v), latency=0.0)
    assert result.busy == pytest.approx(3.0 * m)
    assert result.makespan / result.busy - 1 == pytest.approx(schedules.bubble_ratio(lay))
    assert result.exposed_sends == 0.0


def test_few_microbatches_leave_zbv_a_larger_bubble_than_its_formula() -> None:
    """ZB-V's order is built for m >= 2p - 1 microbatches; with fewer, torch's order idles twice the formula."""
    lay = layout("ZBVZeroBubble", 4, 4, 2)
    result = simulate(lay, uniform(lay, 0.5, 1.0), latency=0.0)
    assert result.makespan / result.busy - 1 == pytest.approx(2 * schedules.bubble_ratio(lay))


def test_sends_on_the_critical_path() -> None:
    """GPipe streams its forwards: only filling and draining wait for sends, 2 (p - 1) of them. 1F1B's steady state
    waits for every round trip, so it pays more for the same sends (here 16 eps against GPipe's 6 eps); interleaving
    doubles the hops but keeps more work in flight to cover them (14 eps)."""
    eps = 0.25
    gpipe = layout("GPipe", 4, 8)
    free, slow = simulate(gpipe, uniform(gpipe), 0.0), simulate(gpipe, uniform(gpipe), eps)
    assert slow.makespan - free.makespan == pytest.approx(2 * 3 * eps)
    assert slow.exposed_sends == pytest.approx(2 * 3 * eps)
    extra = {}
    for name, v in (("1F1B", 1), ("Interleaved1F1B", 2)):
        lay = layout(name, 4, 8, v)
        costs = uniform(lay, 1.0 / v, 2.0 / v)
        result = simulate(lay, costs, eps)
        extra[name] = result.makespan - simulate(lay, costs, 0.0).makespan
        assert result.exposed_sends == pytest.approx(extra[name])  # all of it is sends on the critical path
    assert extra["1F1B"] == pytest.approx(16 * eps)
    assert extra["Interleaved1F1B"] == pytest.approx(14 * eps)


def test_overhead_and_uneven_stages() -> None:
    """A per-action overhead costs every action (a split backward pays it twice); the slowest stage sets the pace."""
    lay = layout("1F1B", 4, 8)
    base = simulate(lay, uniform(lay), 0.0)
    assert simulate(lay, uniform(lay), 0.0, overhead=0.1).busy == pytest.approx(base.busy + 2 * 8 * 0.1)
    zb = layout("InterleavedZeroBubble", 4, 8, 2)
    assert simulate(zb, uniform(zb), 0.0, overhead=0.1).busy == pytest.approx(
        simulate(zb, uniform(zb), 0.0).busy + 3 * 2 * 8 * 0.1
    )
    heavy = [StageCost(1.0, 2.0)] * 3 + [StageCost(2.0, 4.0)]
    result = simulate(lay, heavy, 0.0)
    assert result.busy == pytest.approx(6.0 * 8)
    assert result.makespan > 6.0 * 8


def test_trace_and_bad_costs() -> None:
    lay = layout("1F1B", 2, 2)
    trace: list[tuple[int, float, float, str]] = []
    simulate(lay, uniform(lay), 0.5, trace=trace)
    assert sorted(t for t in trace if t[0] == 1) == [
        (1, 1.5, 2.5, "1F0"),
        (1, 2.5, 4.5, "1B0"),
        (1, 4.5, 5.5, "1F1"),
        (1, 5.5, 7.5, "1B1"),
    ]
    with pytest.raises(ValueError, match="3 stage costs for 2 stages"):
        simulate(lay, [StageCost(1.0, 2.0)] * 3, 0.0)


def test_activations_in_flight_follow_the_order() -> None:
    """The memory model's stage-microbatches in flight, counted in torch's order, against the closed forms."""
    p, m = 4, 8
    assert [schedules.in_flight(layout("1F1B", p, m), r) for r in range(p)] == [4, 3, 2, 1]
    assert [schedules.in_flight(layout("GPipe", p, m), r) for r in range(p)] == [8] * 4
    assert [schedules.in_flight(layout("Interleaved1F1B", p, m, 2), r) for r in range(p)] == [
        (2 - 1) * p + 2 * (p - 1 - r) + 1 for r in range(p)
    ]
    # zero bubble: activations stay until the weight-gradient half (torch's input-gradient pass retains the graph)
    assert [schedules.in_flight(layout("InterleavedZeroBubble", p, m, 2), r) for r in range(p)] == [2 * p] * 4
    assert [schedules.in_flight(layout("ZBVZeroBubble", p, m, 2), r) for r in range(p)] == [2 * p] * 4
    # with fewer than 2p - 1 microbatches ZB-V's last rank, not its first, holds the most
    assert [schedules.in_flight(layout("ZBVZeroBubble", p, p, 2), r) for r in range(p)] == [5, 6, 7, 8]
    assert schedules.in_flight(layout("1F1B", 1, 4), 0) == 1
