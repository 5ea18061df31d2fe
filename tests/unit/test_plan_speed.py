"""The planner's shortcuts for long pipeline schedules equal the full simulation (plan/physics/schedules.py)."""

from __future__ import annotations

import pytest

from meshforge.parallel.pipeline import simulator as sim
from meshforge.plan.layout import Layout
from meshforge.plan.physics import schedules

SHAPES = [
    (schedule, v, p, rounds)
    for schedule, v in (
        ("1F1B", 1),
        ("GPipe", 1),
        ("Interleaved1F1B", 2),
        ("ZBVZeroBubble", 2),
        ("InterleavedZeroBubble", 2),
        ("LoopedBFS", 2),
    )
    for p in (2, 4, 8)
    for rounds in (schedules.IN_FLIGHT_ROUNDS + 2, 9, 16)
]


@pytest.mark.parametrize(("schedule", "v", "p", "rounds"), SHAPES)
def test_long_schedules_extend_exactly(schedule: str, v: int, p: int, rounds: int) -> None:
    """Unequal stages and a send latency: makespan, busy times and activations in flight of the extended short
    simulation equal the full one. The sends on the critical path only split the idle time into sends and bubble, and
    depend on which of several tied paths is followed: within 25 %."""
    layout = Layout(flavor="8B", seq_len=8, local_batch_size=rounds * p, pp=p, schedule=schedule, stages_per_rank=v)
    costs = [sim.StageCost(1.0 + 0.1 * (s % 3), 2.0 + 0.05 * s) for s in range(p * v)]
    for latency in (0.0, 0.3):
        full, fast = sim.simulate(layout, costs, latency, 0.01), schedules.simulate(layout, costs, latency, 0.01)
        assert fast.makespan == pytest.approx(full.makespan, rel=1e-9)
        assert fast.exposed_sends == pytest.approx(full.exposed_sends, rel=0.25, abs=1e-12)
        assert fast.rank_busy == pytest.approx(full.rank_busy, rel=1e-9)
    assert [schedules.in_flight_fast(layout, r) for r in range(p)] == [sim.in_flight(layout, r) for r in range(p)]


def test_search_shortcuts_keep_every_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search with the shortcuts (rank-0 memory bound, extended simulation) keeps the same layouts at the same
    predicted speed, within 0.01 % (a schedule whose rounds repeat with a longer period), as the search that
    simulates every schedule in full (order may differ between layouts tied to rounding)."""
    from meshforge.config.io import load_config
    from meshforge.plan.hardware import load_hardware
    from meshforge.plan.layout import layout_from_config
    from meshforge.plan.search import advisor

    overrides = ["--model.flavor", "70B", "--training.seq_len", "8192", "--training.local_batch_size", "16"]
    base = layout_from_config(load_config(None, overrides), 32)
    hw = load_hardware("h100-96gb")
    fast = advisor.search(base, 32, hw)
    monkeypatch.setattr(schedules, "EXTRAPOLATE_ROUNDS", 10**6)
    full = advisor.search(base, 32, hw)
    assert any(e.layout.pp > 1 and e.layout.schedule_microbatches > 8 * e.layout.pp for e in full.ranked)
    fast_tps = {e.layout: e.tps_per_device for e in fast.ranked}
    full_tps = {e.layout: e.tps_per_device for e in full.ranked}
    assert fast_tps.keys() == full_tps.keys()
    assert [fast_tps[k] for k in full_tps] == pytest.approx(list(full_tps.values()), rel=1e-4)
    assert fast.best.tps_per_device == pytest.approx(full.best.tps_per_device, rel=1e-4)
