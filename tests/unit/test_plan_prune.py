"""The guide's fast search (memoized simulations, pruned by a throughput bound) gives the full search's guide, to the
byte, and its memo keys keep apart what gives different results (plan/search/prune.py, plan/physics/schedules.py)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from meshforge.parallel.pipeline import simulator as sim
from meshforge.plan.guide import flow as guide_flow
from meshforge.plan.guide import guide
from meshforge.plan.hardware import load_hardware
from meshforge.plan.layout import Layout
from meshforge.plan.physics import schedules
from meshforge.plan.search import advisor, prune

CELLS = (("8B", 8, 32768), ("70B", 64, 8192), ("405B", 256, 8192))
"""One cell per model where pipeline layouts compete (3D / 4D recommendations and runner-ups)."""
COUNTS = ("fitting", "pruned")


def _cells(hw: Any) -> list[dict[str, Any]]:
    return [guide.compute_cell(hw, ("--model.flavor", m), w, s, "meshforge") for m, w, s in CELLS]


def _full_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search as it was: no pruning, every simulation run afresh."""
    monkeypatch.setattr(guide, "search", lambda base, world, hw, prune_by=None: advisor.search(base, world, hw))
    monkeypatch.setattr(schedules, "_simulate", schedules._simulate.__wrapped__)


def test_fast_guide_is_byte_identical_to_the_full_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """The markdown (table, flow, launches) and every cell's JSON but the layout counts are byte-identical; the fast
    search checks fewer layouts' memory (the pruned ones), never more."""
    hw = load_hardware("h100")
    fast = _cells(hw)
    with monkeypatch.context() as m:
        _full_search(m)
        full = _cells(hw)
    assert guide_flow.markdown(fast, "h100") == guide_flow.markdown(full, "h100")
    for a, b in zip(fast, full, strict=True):
        assert json.dumps({k: v for k, v in a.items() if k not in COUNTS}) == json.dumps(
            {k: v for k, v in b.items() if k not in COUNTS}
        )
        assert a["fitting"] <= b["fitting"] <= a["fitting"] + a["pruned"]
        assert a["tried"] == b["tried"] and b["pruned"] == 0
    assert sum(c["pruned"] for c in fast) > sum(c["fitting"] for c in fast)  # the pruning is what saves the time


def test_bound_is_above_every_prediction() -> None:
    """For every fitting pipeline layout of a full search: the bound is at least the simulated prediction, and the
    bound served by the memo (keyed without the data-parallel degrees, filled by all the others) equals the one
    computed for this very layout alone."""
    hw = load_hardware("h100")
    base = guide_base("70B", 256, 8192, hw)  # HSDP splits of pipeline layouts: FSDP 8 x 2 replicas and FSDP 16
    result = advisor.search(base, 256, hw)
    piped = [e for e in result.ranked if e.layout.pp > 1]
    assert len(piped) > 100 and len({(e.layout.dp_shard, e.layout.dp_replicate) for e in piped}) > 1
    prune._BOUNDS.clear()
    memoized = [prune.tps_bound(e.layout, hw) for e in piped]
    assert len(prune._BOUNDS) < len(piped)  # the splits share
    for est, bound in zip(piped, memoized, strict=True):
        assert bound >= est.tps_per_device
        prune._BOUNDS.clear()
        assert prune.tps_bound(est.layout, hw) == bound, est.layout.describe()


def guide_base(model: str, world: int, seq: int, hw: Any) -> Layout:
    from meshforge.config.io import load_config
    from meshforge.plan.hardware import auto_param_dtype
    from meshforge.plan.layout import layout_from_config

    cfg = load_config(None, guide.base_overrides(["--model.flavor", model], world, seq))
    return layout_from_config(cfg, 1, impl="meshforge", auto_dtype=auto_param_dtype(hw.spec))


SHAPE = Layout(flavor="8B", seq_len=8, local_batch_size=32, pp=4, schedule="Interleaved1F1B", stages_per_rank=2)
COSTS = [sim.StageCost(1.0 + 0.1 * (s % 3), 2.0 + 0.05 * s) for s in range(8)]
VARIANTS: dict[str, tuple[Layout, list[sim.StageCost], float, float]] = {
    "schedule": (dataclasses.replace(SHAPE, schedule="InterleavedZeroBubble"), COSTS, 0.3, 0.01),
    "pp": (dataclasses.replace(SHAPE, pp=2, stages_per_rank=4), COSTS, 0.3, 0.01),
    "microbatches": (dataclasses.replace(SHAPE, local_batch_size=48), COSTS, 0.3, 0.01),
    "stages_per_rank": (dataclasses.replace(SHAPE, pp=8, stages_per_rank=1, schedule="1F1B"), COSTS, 0.3, 0.01),
    "costs": (SHAPE, [sim.StageCost(c.forward, 2 * c.backward) for c in COSTS], 0.3, 0.01),
    "latency": (SHAPE, COSTS, 0.7, 0.01),
    "overhead": (SHAPE, COSTS, 0.3, 0.2),
}


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_simulation_memo_keeps_apart_every_field(field: str) -> None:
    """Each variant differs from the base in one field of the memo's key and has a different result: served after
    the base, it must still be its own simulation (a key without that field would hand back the base's)."""
    schedules._simulate.cache_clear()
    base = schedules.simulate(SHAPE, COSTS, 0.3, 0.01)
    layout, costs, latency, overhead = VARIANTS[field]
    got = schedules.simulate(layout, costs, latency, overhead)
    want = schedules._simulate.__wrapped__(
        sim.Shape(layout.schedule, layout.pp, layout.schedule_microbatches, layout.stages_per_rank),
        tuple(costs),
        latency,
        overhead,
        schedules.EXTRAPOLATE_ROUNDS,
    )
    assert want != base
    assert got == want


def test_simulation_memo_keeps_apart_the_shortcut(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension's setting is in the key: the full simulation after the extended one is the full one."""
    layout = dataclasses.replace(SHAPE, local_batch_size=64)
    schedules._simulate.cache_clear()
    extended = schedules.simulate(layout, COSTS, 0.3, 0.01)
    monkeypatch.setattr(schedules, "EXTRAPOLATE_ROUNDS", 10**6)
    full = sim.simulate(layout, COSTS, 0.3, 0.01)
    assert extended != full  # the sends on the critical path differ between tied paths
    assert schedules.simulate(layout, COSTS, 0.3, 0.01) == full


def test_rank_work_is_every_simulated_rank_busy_time() -> None:
    """The bound's work per rank equals the simulation's busy time for every schedule (split backwards included)."""
    for schedule, v in (("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)):
        layout = dataclasses.replace(SHAPE, schedule=schedule, stages_per_rank=v, local_batch_size=8)
        costs = COSTS[: layout.num_stages]
        assert sim.rank_work(layout, costs, 0.01) == pytest.approx(sim.simulate(layout, costs, 0.3, 0.01).rank_busy)


def _guide_picks(ranked: list[Any]) -> tuple[Any, ...]:
    """What a guide cell keeps of a ranking (guide.compute_cell): the recommendation, each family's fastest and the
    runner-up (the first of another family, else the next layout)."""
    by_speed = sorted(ranked, key=lambda e: -e.tps_per_device)
    families: dict[str, Any] = {}
    for e in by_speed:
        families.setdefault(guide.family(e.layout), e)
    others = [e for e in ranked if guide.family(e.layout) != guide.family(ranked[0].layout)]
    runner = others[0] if others else next((e for e in ranked[1:] if e.layout != ranked[0].layout), None)
    return ranked[0].layout, {f: e.layout for f, e in families.items()}, runner and runner.layout


@pytest.mark.parametrize("seed", range(40))
def test_pruning_keeps_what_the_guide_picks(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random pipeline layouts with random speeds and bounds above them: the pruned ranking picks the full ranking's
    recommendation (simpler layouts within the margin first), family bests and runner-up. Cells where one family
    holds everything, or where the simplest layout within the margin is not among its family's fastest, are what
    the search's own grid rarely has."""
    import random
    from types import SimpleNamespace

    rng = random.Random(seed)
    degrees = [(tp, cp, rep) for tp in (1, 2) for cp in (1, 2) for rep in (1, 2)]
    if seed % 4 == 0:  # one family only
        degrees = [(1, 1, rep) for rep in (1, 2)]
    layouts = [
        Layout(flavor="8B", seq_len=8192, local_batch_size=8 + i, pp=2, tp=tp, cp=cp, dp_replicate=rep)
        for i, (tp, cp, rep) in enumerate(rng.choice(degrees) for _ in range(rng.randint(2, 30)))
    ]
    near = 0.5 if seed % 4 else 0.0  # one family: spread out, so the runner-up is outside the margin
    tps = {lay: rng.uniform(90, 100) if rng.random() < near else rng.uniform(10, 100) for lay in layouts}
    bound = {lay: tps[lay] * rng.uniform(1.0, 1.2) for lay in layouts}
    monkeypatch.setattr(prune, "tps_bound", lambda lay, hw, args=None: bound[lay])
    monkeypatch.setattr(
        prune, "estimate", lambda lay, hw: SimpleNamespace(layout=lay, tps_per_device=tps[lay], peak_memory_gib=1.0)
    )
    hw = load_hardware("h100")
    fits = lambda lay: lay.local_batch_size % 7 != 0  # noqa: E731  # some layouts do not fit
    kept, fitting, _ = prune.needed_estimates(layouts, hw, guide.family, advisor.SIMPLICITY_MARGIN, None, fits)  # type: ignore[arg-type]
    full = [prune.estimate(lay, hw) for lay in layouts if fits(lay)]
    if not full:
        return
    assert _guide_picks(advisor.recommendation_order(kept)) == _guide_picks(advisor.recommendation_order(full))
    assert fitting <= len(full)


def test_pruning_keeps_a_simpler_layout_within_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two fast 4D layouts with every dimension and a simpler 4D one 4 % slower (within the margin, not among its
    family's two fastest): the simpler one is kept, and recommended."""
    from types import SimpleNamespace

    full4d = [
        Layout(flavor="8B", seq_len=8192, local_batch_size=8 + i, pp=2, tp=2, cp=2, dp_replicate=2) for i in (0, 1)
    ]
    simple = Layout(flavor="8B", seq_len=8192, local_batch_size=10, pp=2, cp=2)
    tps = {full4d[0]: 100.0, full4d[1]: 99.5, simple: 96.0}
    monkeypatch.setattr(prune, "tps_bound", lambda lay, hw, args=None: tps[lay] * 1.01)
    monkeypatch.setattr(
        prune, "estimate", lambda lay, hw: SimpleNamespace(layout=lay, tps_per_device=tps[lay], peak_memory_gib=1.0)
    )
    kept, _, pruned = prune.needed_estimates(
        [*full4d, simple],
        load_hardware("h100"),
        guide.family,
        advisor.SIMPLICITY_MARGIN,
        None,
        lambda lay: True,  # type: ignore[arg-type]
    )
    assert pruned == 0 and advisor.recommendation_order(kept)[0].layout == simple
