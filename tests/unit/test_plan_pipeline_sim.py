"""The planner's pipeline simulation: torch's schedule orders, the closed-form bubbles, and what sends cost."""

from __future__ import annotations

import warnings

import pytest

from meshforge.parallel.pipeline.simulator import StageCost, rank_order, simulate, spell
from meshforge.plan.layout import Layout
from meshforge.plan.physics import schedules

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


def test_orders_given_directly() -> None:
    """simulate_orders (CSV and runtime lists): a send is charged by where the input was made, even when one stage's
    microbatches run on two ranks; malformed orders are named."""
    from meshforge.parallel.pipeline.simulator import BACKWARD as B
    from meshforge.parallel.pipeline.simulator import FORWARD as F
    from meshforge.parallel.pipeline.simulator import INPUT as I
    from meshforge.parallel.pipeline.simulator import WEIGHT as W
    from meshforge.parallel.pipeline.simulator import simulate_orders

    costs = [StageCost(1.0, 2.0)] * 2
    orders = [[(F, 0, 0), (B, 0, 0)], [(F, 0, 1), (F, 1, 0), (F, 1, 1), (B, 1, 0), (B, 1, 1), (B, 0, 1)]]
    # rank 1: F01 0-1, F10 waits for rank 0's F00 (1 + 5) 6-7, F11 7-8, B10 8-10, B11 10-12, B01 12-14;
    # rank 0: B00 waits for B10 (10 + 5) 15-17
    assert simulate_orders(orders, costs, latency=5.0).makespan == pytest.approx(17.0)
    for bad, match in (
        ([[(F, 0, 0), (F, 2, 0)]], "outside 0 .. 1"),
        ([[(F, 0, 0), (F, 0, 0)]], "repeats a pass"),
        ([[(F, 0, 0), (F, 1, 0), (B, 1, 0), (W, 1, 0), (B, 0, 0)]], "follows a full backward"),
        ([[(F, 0, 0), (F, 1, 0), (I, 1, 0), (B, 1, 0)]], "repeats a pass"),
        ([[(F, 1, 0), (F, 0, 0)]], "deadlocks: rank 0's action 1 \\(1F0\\)"),
    ):
        with pytest.raises(ValueError, match=match):
            simulate_orders(bad, costs)
    with pytest.raises(ValueError, match="pipeline_parallel_degree >= 2"):
        simulate(layout("1F1B", 1, 4), [StageCost(1.0, 2.0)], 0.0)


def test_gradient_accumulation_repeats_the_schedule() -> None:
    """Each accumulation step runs the schedule again: the bubble and sends repeat, the activations in flight do not."""
    from dataclasses import replace

    from meshforge.plan.hardware import load_hardware
    from meshforge.plan.physics.estimate import estimate

    hw = load_hardware("h100")
    one = Layout(flavor="debugmodel", seq_len=2048, local_batch_size=8, pp=4, schedule="GPipe")
    four = replace(one, grad_accum=4)
    a, b = estimate(one, hw), estimate(four, hw)
    for key in ("compute", "pipeline_bubble"):
        assert b.time[key] == pytest.approx(4 * a.time[key])
    assert schedules.in_flight(four, 0) == schedules.in_flight(one, 0) == 8
    assert b.memory.activations == pytest.approx(a.memory.activations)


def test_v_shaped_schedules_need_two_stages_per_rank() -> None:
    from meshforge.config.io import ConfigError
    from meshforge.model.flavors import get_flavor

    five = Layout(
        flavor="debugmodel", seq_len=128, local_batch_size=4, pp=2, schedule="ZBVZeroBubble", layers_per_stage=1
    )
    with pytest.raises(ConfigError, match=r"= 4 per rank, but this schedule needs exactly 2 stage\(s\) per rank"):
        five.check(get_flavor("debugmodel"))  # (6 layers + embedding + output) / 1 per stage over 2 ranks
