"""Layout search: enumerate the valid layouts for N devices, drop those that do not fit, rank by predicted tokens/s.

The global batch (sequences per optimizer step) of the given config is kept: each candidate's local batch is that
divided by its data-parallel degree. Compile is turned on (it never costs speed in the model), Float8 where the device
has fp8 tensor cores, async TP only where a measurement confirms the implementation's overlap (TorchTitan's; never
meshforge's yet); AC mode, pipeline schedule and microbatch size are searched, and for MoE flavors the expert-parallel
degree (every divisor of the expert count that training's rules allow). What is left out is said, with why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field, replace

from meshforge.config.io import ConfigError
from meshforge.model.flavors import ModelArgs
from meshforge.parallel.degrees import check_ep_degrees, check_ep_shape
from meshforge.plan.hardware import GIB, HardwareProfile
from meshforge.plan.layout import (
    SPLIT_BACKWARD,
    Layout,
    layout_args,
    stage_layer_counts,
    with_stages,
)
from meshforge.plan.physics.estimate import ASYNC_TP_CONFIRMED, Estimate, estimate
from meshforge.plan.physics.levers import device_state_numel, effective, host_memory_gib
from meshforge.plan.physics.levers import offloads_apply as levers_apply
from meshforge.plan.physics.memory import STATE_BYTES
from meshforge.plan.physics.parts import local_param_numel, rank_parts
from meshforge.plan.physics.peak import memory, rank_memory
from meshforge.plan.search.lever_search import fitting_lever
from meshforge.plan.search.prune import needed_estimates

SEARCH_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
AC_MODES = ("none", "selective", "full")
MIN_CP_CHUNK = 4096
"""Context parallel is only tried while each rank keeps at least this many tokens of a sequence."""
SIMPLICITY_MARGIN = 0.05
"""Among layouts within this fraction of the fastest (about the model's median error on the article), the one with the
fewest parallel dimensions is recommended: extra dimensions cost engineering and risk the model does not see."""
HSDP_SHARD_SIZES = (8, 16, 32, 64)
"""Shard-group sizes tried for HSDP (dp_replicate > 1); plain FSDP over all data-parallel ranks is always tried."""


@dataclass
class SearchResult:
    """Ranked fitting candidates (best first), how many were tried, and the given layout's own estimate."""

    ranked: list[Estimate]
    tried: int
    baseline: Estimate | None
    excluded: list[tuple[str, str]] = field(default_factory=list)
    """Features the search left out on this hardware / implementation, with the reason."""
    fitting: int = 0
    """Layouts checked and found to fit: len(ranked) unless the search was pruned (``search(prune_by=...)``)."""
    pruned: int = 0
    """Layouts a pruned search ruled out by their throughput bound before checking their memory."""

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structures(args: ModelArgs, base: Layout, world: int, devices_per_node: int) -> Iterator[tuple[int, ...]]:
    """(dp_replicate, dp_shard, cp, tp, pp) with a product of ``world`` that the model and batch allow."""
    global_seqs = base.local_batch_size * base.dp * base.grad_accum
    for tp in divisors(world):
        if tp > devices_per_node or any(
            x % tp for x in (args.n_heads, args.kv_heads, args.ffn_hidden_dim, args.vocab_size, base.seq_len)
        ):
            continue
        for cp in divisors(world // tp):
            if cp > 1 and (base.seq_len % (2 * cp) or base.seq_len // cp < MIN_CP_CHUNK):
                continue
            for pp in divisors(world // (tp * cp)):
                if not pipeline_splits(args, base, pp):
                    continue
                dp = world // (tp * cp * pp)
                if global_seqs % dp:
                    continue
                for rep in [1] + [dp // s for s in HSDP_SHARD_SIZES if s < dp and dp % s == 0]:
                    yield rep, dp // rep, cp, tp, pp


def pipeline_splits(args: ModelArgs, base: Layout, pp: int) -> bool:
    """Whether training can split the model into ``pp`` stages (parallel/pipeline/split.py split_evenly, the embedding
    and the output weighted as first/last_stage_less_layers blocks): any degree up to n_layers + those, the first and
    last stage then a block or more short. Each stage is priced with its own blocks (physics stage_costs / rank_parts),
    so a pipeline deeper than n_layers / 2 is predicted with its real, uneven split. Schedules with more stages per rank
    are checked per layout (Layout.check)."""
    if pp == 1:
        return True
    try:
        stage_layer_counts(args.n_layers, replace(base, pp=pp, stages_per_rank=1))
    except ConfigError:
        return False
    return True


def ep_options(args: ModelArgs, rep: int, shard: int, cp: int) -> list[int]:
    """Expert-parallel degrees to try: 1 for dense flavors, else the divisors of the expert count that pass training's
    checks (parallel/degrees.py) for this dp_replicate x dp_shard x cp."""
    out = []
    for ep in divisors(args.n_routed_experts) if args.is_moe else [1]:
        try:
            check_ep_degrees(ep, shard, cp, rep)
            check_ep_shape(ep, shard * cp // ep, args)
        except ConfigError:
            continue
        out.append(ep)
    return out


def excluded_features(base: Layout, hw: HardwareProfile) -> list[tuple[str, str]]:
    """What the search does not turn on, and why: features this hardware cannot run, and features whose benefit no
    measurement has confirmed for this implementation (the model would credit nothing, so they only add risk)."""
    out = []
    if hw.spec.peak_fp8_flops == 0:
        out.append(("Float8", f"{hw.name} has no fp8 tensor cores"))
    if not hw.spec.is_gpu:
        out.append(("async TP", f"needs CUDA symmetric memory; {hw.name} has none"))
    elif base.impl not in ASYNC_TP_CONFIRMED:
        out.append(("async TP", f"no overlap credited to {base.impl}'s async TP until a GPU run confirms it"))
    out.append(
        (
            "ring CP",
            "its hiding is credited to no implementation until a GPU run confirms it; CP is searched as the all-gather",
        )
    )
    return out


def candidates(args: ModelArgs, base: Layout, world: int, hw: HardwareProfile) -> Iterator[Layout]:
    """Every layout to try for ``world`` devices."""
    global_seqs = base.local_batch_size * base.dp * base.grad_accum
    for rep, shard, cp, tp, pp in structures(args, base, world, hw.spec.devices_per_node):
        for ep in ep_options(args, rep, shard, cp):
            yield from layouts_of(args, base, (rep, shard, cp, tp, pp, ep), global_seqs // (rep * shard), hw)


def layouts_of(
    args: ModelArgs, base: Layout, degrees: tuple[int, ...], lbs: int, hw: HardwareProfile
) -> Iterator[Layout]:
    """The schedules, AC modes and Float8 settings of one structure (dp_replicate, dp_shard, cp, tp, pp, ep)."""
    rep, shard, cp, tp, pp, ep = degrees
    fp8_options = (False, True) if hw.spec.peak_fp8_flops > 0 else (False,)
    async_tp = hw.spec.is_gpu and base.impl in ASYNC_TP_CONFIRMED
    shape = replace(
        base,
        dp_replicate=rep,
        dp_shard=shard,
        cp=cp,
        ep=ep,
        tp=tp,
        pp=pp,
        local_batch_size=lbs,
        grad_accum=1,
        compile=ep == 1,  # training refuses compile under expert parallel
        async_tp=tp > 1 and async_tp and ep == 1,  # async TP needs compile
        cp_impl="allgather" if cp > 1 else base.cp_impl,
        reshard_after_forward=pp == 1,
        layers_per_stage=-1,
    )
    for pipe in pipeline_options(shape):
        staged = with_stages(pipe, args)  # stages per rank follow the schedule, not the AC mode or Float8
        for ac in AC_MODES:
            for fp8 in fp8_options:
                yield replace(staged, ac_mode=ac, sac_option="op", float8=fp8)


def pipeline_options(layout: Layout) -> Iterator[Layout]:
    """Schedules x microbatch sizes: up to three sizes with at least as many microbatches as stages."""
    if layout.pp == 1:
        yield layout
        return
    sizes = [mb for mb in divisors(layout.local_batch_size) if layout.local_batch_size // mb >= layout.pp]
    for mb in sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]}) if sizes else []:
        for schedule in SEARCH_SCHEDULES:
            split = schedule in SPLIT_BACKWARD and layout.impl == "meshforge"  # cannot split compiled backwards
            yield replace(
                layout,
                schedule=schedule,
                microbatch_size=mb,
                compile=layout.compile and not split,
                async_tp=layout.async_tp and not split,
            )


def search(
    base: Layout, world: int, hw: HardwareProfile, prune_by: Callable[[Layout], Hashable] | None = None
) -> SearchResult:
    """Rank the fitting layouts for ``world`` devices by predicted tokens/s per device (ties: less memory). A layout
    that does not fit is retried with the memory levers (plan/search/lever_search.py): at once without a pipeline;
    pipeline layouts (whose schedule simulation is most of the search's cost) only when nothing else fits. ``prune_by``:
    rank only those that can be the recommendation or among the two fastest of their group (prune.py: the
    recommendation, each group's best and the runner-up are the full ranking's, the others are not checked)."""
    args = layout_args(base)
    ranked: list[Estimate] = []
    passed: list[Layout] = []
    deferred: list[Layout] = []
    tried = fitting = pruned = 0
    usable = hw.spec.device_memory_gib(world) - hw.spec.runtime_gib
    too_big: set[tuple[int | str, ...]] = set()
    for layout in candidates(args, base, world, hw):
        tried += 1
        shape = (layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.pp, layout.ep, layout.schedule)
        if shape in too_big:  # its model state alone does not fit, even with the levers
            continue
        try:
            layout.check(args)
            state_fits = state_gib(args, layout, hw) <= usable
        except ConfigError:
            continue
        if prune_by is not None and layout.pp > 1 and state_fits:
            passed.append(layout)  # its memory is checked by needed_estimates if its bound can matter
            continue
        admitted = layout if state_fits and fits(args, layout, hw, usable) else None
        if admitted is None and layout.pp == 1:
            admitted = fitting_lever(args, layout, hw, usable)
        if admitted is None:
            deferred += [layout] if layout.pp > 1 else []
            too_big |= set() if state_fits or offload_may_hold(args, layout, hw) else {shape}
        elif prune_by is not None:
            passed.append(admitted)
        else:
            fitting += 1
            ranked.append(estimate(admitted, hw))
    if prune_by is not None:
        check = functools.partial(fits, args, hw=hw, usable=usable)
        ranked, fitting, pruned = needed_estimates(passed, hw, prune_by, SIMPLICITY_MARGIN, args, check)
        deferred += [] if ranked else [layout for layout in passed if layout.pp > 1]
    if not ranked:
        rescued_pp = (fitting_lever(args, layout, hw, usable) for layout in deferred)
        ranked = [estimate(layout, hw) for layout in rescued_pp if layout is not None]
        fitting += len(ranked)
    ranked = recommendation_order(ranked)
    baseline = None
    if base.world_size == world:
        try:
            baseline = estimate(base, hw)
        except ConfigError:
            baseline = None
    if not ranked:
        raise ConfigError(
            f"no layout of {base.flavor} fits {world} x {hw.name} at global batch "
            f"{base.local_batch_size * base.dp * base.grad_accum} x seq {base.seq_len}"
        )
    return SearchResult(ranked, tried, baseline, excluded_features(base, hw), fitting, pruned)


def fits(args: ModelArgs, layout: Layout, hw: HardwareProfile, usable: float) -> bool:
    """Whether the peak over the pipeline ranks is within ``usable`` GiB. Rank 0's peak bounds it from below: most
    layouts that do not fit stop there."""
    try:
        return rank_memory(args, layout, hw, 0).peak <= usable and memory(args, layout, hw).peak <= usable
    except ConfigError:
        return False


def offload_may_hold(args: ModelArgs, layout: Layout, hw: HardwareProfile) -> bool:
    """Whether FSDP CPU offload could hold this shape's model state: offloads move memory on this hardware and rank 0's
    fp32 state fits the host's share per GPU (levers.host_memory_gib). Where it could, a shape whose state does not
    fit the device stays open: another AC mode or microbatch of it may fit with the offload."""
    numel = local_param_numel(args, layout, rank_parts(args, layout, 0))
    host = numel * sum(STATE_BYTES.values()) / GIB
    return levers_apply(hw) and host <= host_memory_gib(hw)


def state_gib(args: ModelArgs, layout: Layout, hw: HardwareProfile) -> float:
    """Rank 0's parameters and optimizer state with the allocator's share: a lower bound of its peak (every peak of
    plan/physics/peak.py holds them; the gradients only some) that depends only on the degrees and the schedule's
    stages."""
    numel = local_param_numel(args, layout, rank_parts(args, layout, 0))
    numel = device_state_numel(effective(layout, hw), numel)  # CPU offload: on the host
    eff = hw.efficiency
    resident = STATE_BYTES["params"] + STATE_BYTES["optimizer"]
    return numel * resident * (1 + eff.allocator_overhead) / GIB + eff.framework_gib


def complexity(layout: Layout) -> int:
    """Parallel dimensions beyond plain FSDP."""
    return sum(d > 1 for d in (layout.tp, layout.pp, layout.cp, layout.dp_replicate, layout.ep))


def recommendation_order(estimates: list[Estimate]) -> list[Estimate]:
    """Fastest first, except that within SIMPLICITY_MARGIN of the fastest, fewer parallel dimensions come first."""
    ranked = sorted(estimates, key=lambda e: (-e.tps_per_device, e.peak_memory_gib))
    if not ranked:
        return ranked
    floor = (1 - SIMPLICITY_MARGIN) * ranked[0].tps_per_device
    pool = [e for e in ranked if e.tps_per_device >= floor]
    pool.sort(key=lambda e: (complexity(e.layout), -e.tps_per_device))
    return pool + ranked[len(pool) :]


def best_by(result: SearchResult, key: str) -> list[Estimate]:
    """The best fitting layout for each value of ``key`` ('tp', 'pp', 'schedule', 'ac_mode', ...)."""
    seen: dict[object, Estimate] = {}
    for est in result.ranked:
        value = getattr(est.layout, key) if key != "schedule" or est.layout.pp > 1 else "none (PP 1)"
        seen.setdefault(value, est)
    return list(seen.values())
