"""The search's pruning for callers that need only the top of the ranking (`meshforge plan --guide`). Pure Python.

Most of a search's time is the pipeline simulations of layouts that are nowhere near the fastest. A pipeline layout's
step is at least its busiest rank's work (simulator.rank_work: no bubble, no exposed sends, no FSDP or optimizer
time, all of which only add), so ``tps_bound`` is an upper bound of its predicted tokens/s that needs no simulation.
``needed_estimates`` estimates every layout without pipeline parallel (cheap), then the pipeline layouts in the order
of their bounds, and skips one whose bound is below both the simplicity floor (SIMPLICITY_MARGIN under the fastest so
far: it cannot join the recommendation's pool) and the second fastest of its group so far (it cannot be its group's
best nor, when one group holds everything, the runner-up). What it keeps ranks exactly as the full search ranks it:
the recommendation, the best of each group and the runner-up of another group are the full search's, to the bit
(tests/unit/test_plan_prune.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import fields

from meshforge.model.flavors import ModelArgs
from meshforge.parallel.pipeline.simulator import rank_work
from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.layout import Layout, layout_args
from meshforge.plan.physics.estimate import Estimate, estimate, rates, stage_costs

BOUND_SLACK = 1e-6
"""Relative slack on the bound: the simulation sums the same work in another order (rounding), and the extension of a
long schedule (schedules.simulate) keeps its makespan above its busiest rank only to 1e-9."""


def tps_bound(layout: Layout, hw: HardwareProfile, args: ModelArgs | None = None) -> float:
    """An upper bound of ``estimate(layout, hw).tps_per_device`` for a pipeline layout on a GPU profile, without
    simulating the schedule; infinity where no cheap bound holds (a CPU host's slowdown follows the simulation).
    ``args``: the layout's model shapes (layout_args) when the caller has them."""
    if layout.pp == 1 or hw.spec.node_cores:
        return float("inf")
    key = (tuple(getattr(layout, f.name) for f in fields(layout) if f.name not in SPLIT_FIELDS), hw)
    if key not in _BOUNDS:
        if len(_BOUNDS) > MEMO_SIZE:
            _BOUNDS.clear()
        costs = stage_costs(args or layout_args(layout), layout, hw, rates(layout, hw), 1.0)
        busiest = max(rank_work(layout, costs, hw.spec.stage_overhead))
        _BOUNDS[key] = layout.tokens_per_device_step / (layout.grad_accum * busiest) * (1 + BOUND_SLACK)
    return _BOUNDS[key]


SPLIT_FIELDS = ("dp_replicate", "dp_shard")
"""Left out of the bound's memo key: a stage's work is one microbatch's compute and its tensor / context parallel
communication, which the data-parallel split does not change, nor the tokens per device (the local batch is per
data-parallel rank), so every split of a structure has one bound (tests/unit/test_plan_prune.py checks it)."""
_BOUNDS: dict[tuple[tuple[object, ...], HardwareProfile], float] = {}
MEMO_SIZE = 1 << 16


def needed_estimates(
    layouts: Sequence[Layout],
    hw: HardwareProfile,
    group: Callable[[Layout], Hashable],
    margin: float,
    args: ModelArgs,
    fits: Callable[[Layout], bool],
) -> tuple[list[Estimate], int, int]:
    """The estimates of the ``layouts`` that ``fits`` (in their order; all of model ``args``) and can be within
    ``margin`` of the fastest or among the two fastest of their ``group``, how many were found to fit, and how many
    were ruled out by their bound before their memory was checked."""
    done: dict[int, Estimate] = {}
    bounds: list[tuple[float, int]] = []
    for i, layout in enumerate(layouts):
        if layout.pp > 1 and not hw.spec.node_cores:
            bounds.append((tps_bound(layout, hw, args), i))
        elif fits(layout):
            done[i] = estimate(layout, hw)
    fitting, pruned = len(done), 0
    fastest = max((e.tps_per_device for e in done.values()), default=0.0)
    top: dict[Hashable, list[float]] = {}
    for e in done.values():
        _push(top.setdefault(group(e.layout), []), e.tps_per_device)
    for bound, i in sorted(bounds, key=lambda b: (-b[0], b[1])):
        two = top.setdefault(group(layouts[i]), [])
        if bound < (1 - margin) * fastest and len(two) == 2 and bound < two[1]:
            pruned += 1
            continue
        if not fits(layouts[i]):
            continue
        fitting += 1
        est = done[i] = estimate(layouts[i], hw)
        fastest = max(fastest, est.tps_per_device)
        _push(two, est.tps_per_device)
    return [done[i] for i in sorted(done)], fitting, pruned


def _push(two: list[float], tps: float) -> None:
    """Keep the two largest values, largest first."""
    two.append(tps)
    two.sort(reverse=True)
    del two[2:]
