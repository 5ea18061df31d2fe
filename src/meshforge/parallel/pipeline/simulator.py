"""One pipeline step, simulated: every pipeline rank's actions in its schedule's order, their dependencies and the
time a send takes between ranks. Pure Python.

Closed-form bubbles ((p-1)/m, (p-1)/(v m), ...; schedules.py) assume sends are free and every action costs only its
work. When a send or an action's host overhead costs as much as a stage's work (small microbatches, slow links, a CPU
host) they interact with the bubble in ways no sum captures: GPipe streams its forwards and pays the latency only while
filling and draining, 1F1B pays it in every steady-state round trip, interleaving doubles the hops but also the work in
flight. So the planner runs the schedule:

- Orders: each rank runs its actions in the order torch.distributed.pipelining lists them (GPipe, looped BFS: all
  forwards, then all backwards; 1F1B and interleaved 1F1B: warm-up forwards, then a forward and a backward in turn,
  then the remaining backwards, microbatches in rounds of p through the local stages, Narayanan et al. 2021; ZB-V's
  phases, Qi et al. 2024; interleaved zero bubble: interleaved 1F1B whose weight-gradient halves trail the
  input-gradient halves by ``rank`` actions). DualPipeV runs ZB-V's order (its overlap of one chunk's forward with the
  other's backward is not modelled). tests/unit/test_plan_pipeline_sim.py checks the orders against torch's.
- Dependencies: a forward of (stage s, microbatch j) needs stage s-1's forward of j; a backward (the input-gradient
  half in zero-bubble schedules) needs its own forward and stage s+1's backward of j; a weight-gradient half needs its
  input-gradient half. Crossing ranks adds the send time.
- An action starts when its rank is free and its inputs have arrived; the step ends with the last action.

With free sends and no overhead the simulated bubble equals the closed form whenever m is a multiple of p (ZB-V: and
m >= 2p - 1; with fewer its order idles more, twice the formula at m = p). Gradient accumulation runs the schedule
once per accumulation step, so one schedule step is simulated and the estimate multiplies it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from meshforge.errors import ConfigError
from meshforge.parallel.pipeline.catalog import SPLIT_BACKWARD, V_SHAPED, stages_of_rank


class ScheduleShape(Protocol):
    """What a simulation needs of a job: the schedule, pipeline ranks, stages per rank, microbatches per schedule step
    (the planner's Layout has these)."""

    @property
    def schedule(self) -> str: ...
    @property
    def pp(self) -> int: ...
    @property
    def stages_per_rank(self) -> int: ...
    @property
    def schedule_microbatches(self) -> int: ...
    @property
    def num_stages(self) -> int: ...


@dataclass(frozen=True)
class Shape:
    """A schedule shape on its own (schedule, pp ranks, m microbatches per schedule step, v stages per rank)."""

    schedule: str
    pp: int
    schedule_microbatches: int
    stages_per_rank: int = 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank


FORWARD, BACKWARD, WEIGHT, INPUT = 0, 1, 2, 3
"""Action kinds: a forward, a full backward, and the weight- and input-gradient halves of a split backward."""
KIND_LETTERS = "FBWI"
Action = tuple[int, int, int]
"""(kind, stage, microbatch)."""
WEIGHT_SHARE = 0.5
"""Share of a backward that is weight gradients (dW = dY^T X against dX = dY W^T: one matmul each per linear)."""


@dataclass(frozen=True)
class StageCost:
    """Seconds of one microbatch through one stage: forward, backward (input and weight gradients together)."""

    forward: float
    backward: float


@dataclass(frozen=True)
class StepResult:
    """The simulated step: its wall time, every rank's busy time, and the time the sends on its critical path take
    (the chain of actions, each waiting for the one before, that ends last)."""

    makespan: float
    rank_busy: tuple[float, ...]
    exposed_sends: float

    @property
    def busy(self) -> float:
        """The busiest rank's busy time."""
        return max(self.rank_busy)

    @property
    def mean_busy(self) -> float:
        return sum(self.rank_busy) / len(self.rank_busy)


def spell(action: Action) -> str:
    """torch's spelling of an action: 3F1 = stage 3 forward of microbatch 1; B, I (input grads), W (weight grads)."""
    kind, s, j = action
    return f"{s}{KIND_LETTERS[kind]}{j}"


def rank_order(layout: ScheduleShape, rank: int) -> list[Action]:
    """Every action of ``rank`` in the order its schedule runs it."""
    p, m, v = layout.pp, layout.schedule_microbatches, layout.stages_per_rank
    local = sorted(stages_of_rank(layout.schedule, p, v, rank))
    rounds = max(1, m // p)
    group = m // rounds

    def key(chunk: int, j: int) -> tuple[int, int, int]:
        return (j // group, chunk, j % group)

    forwards = sorted(((c, j) for c in range(v) for j in range(m)), key=lambda cj: key(*cj))
    backwards = sorted(((c, j) for c in range(v) for j in range(m)), key=lambda cj: key(v - 1 - cj[0], cj[1]))
    if layout.schedule == "LoopedBFS":
        forwards.sort()
        backwards.sort(key=lambda cj: (-cj[0], -cj[1]))
    if layout.schedule in V_SHAPED:
        return v_order(p, m, rank, local)
    fwd = [(FORWARD, local[c], j) for c, j in forwards]
    backward = INPUT if layout.schedule in SPLIT_BACKWARD else BACKWARD
    bwd = [(backward, local[c], j) for c, j in backwards]
    if layout.schedule in ("GPipe", "LoopedBFS"):
        return fwd + bwd
    if layout.schedule == "1F1B":
        warmup = min(m, p - 1 - rank)
    else:  # torch's _get_warmup_ops: interleaved 2 per hop from the last rank, interleaved zero bubble 1
        factor = 1 if layout.schedule == "InterleavedZeroBubble" else 2
        warmup = min(v * m, (v - 1) * group + factor * (p - 1 - rank))
    zero_bubble = layout.schedule in SPLIT_BACKWARD
    order, weights = fwd[:warmup], [(WEIGHT, s, j) for _, s, j in bwd]
    done = 0
    for k, b in enumerate(bwd):
        if k < len(fwd) - warmup:
            order.append(fwd[warmup + k])
        order.append(b)
        if zero_bubble and k >= rank:  # weight gradients trail the input gradients by `rank` actions
            order.append(weights[done])
            done += 1
    return order + (weights[done:] if zero_bubble else [])


def v_order(p: int, m: int, rank: int, local: list[int]) -> list[Action]:
    """ZB-V's phases (Qi et al. 2024, as torch runs them): warm up with 2 (p - rank) - 1 forwards of the first
    chunk, then rank times a forward of each chunk, then p - rank times the second chunk's forward, backward and
    weight gradients; in the steady state each chunk in turn does the three; cool down with the backwards left,
    deferring weight gradients to fill the drain. Microbatches are counted as if there were at least 2 p - 1, and the
    ones that do not exist are skipped."""
    first, second = local
    counters: dict[int, dict[int, int]] = {kind: {first: 0, second: 0} for kind in (FORWARD, INPUT, WEIGHT)}
    count, back, weight = counters[FORWARD], counters[INPUT], counters[WEIGHT]
    order: list[Action] = []

    def step(kind: int, stage: int) -> None:
        index = counters[kind]
        if index[stage] < m:
            order.append((kind, stage, index[stage]))
        index[stage] += 1

    n = max(2 * p - 1, m)
    for _ in range(2 * (p - rank) - 1):
        step(FORWARD, first)
    for _ in range(rank):
        step(FORWARD, second)
        step(FORWARD, first)
    for _ in range(p - rank):
        step(FORWARD, second)
        step(INPUT, second)
        step(WEIGHT, second)
    while count[second] < count[first] or count[first] < n:
        if count[first] < n:
            step(FORWARD, first)
        for stage in (first, second):
            if stage == second:
                step(FORWARD, second)
            step(INPUT, stage)
            step(WEIGHT, stage)
    for _ in range(rank):
        step(INPUT, first)
        step(INPUT, second)
    for _ in range(p - rank):
        step(INPUT, first)
        step(WEIGHT, first)
    while weight[second] < back[second]:
        step(WEIGHT, second)
    while weight[first] < back[first]:
        step(WEIGHT, first)
    return order


def in_flight(layout: ScheduleShape, rank: int) -> int:
    """The most stage-microbatches whose activations ``rank`` holds at once in its schedule's order: forwards whose
    backward has not run yet (in zero-bubble schedules, whose weight-gradient half has not: torch's input-gradient pass
    retains the graph for it)."""
    return _in_flight(layout.schedule, layout.pp, layout.schedule_microbatches, layout.stages_per_rank, rank)


@functools.lru_cache(maxsize=4096)
def _in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    held = peak = 0
    for kind, _, _ in rank_order(Shape(schedule, p, m, v), rank):
        held += 1 if kind == FORWARD else -1 if kind in (BACKWARD, WEIGHT) else 0
        peak = max(peak, held)
    return peak


def simulate(
    layout: ScheduleShape,
    costs: Sequence[StageCost],
    latency: float,
    overhead: float = 0.0,
    trace: list[tuple[int, float, float, str]] | None = None,
) -> StepResult:
    """One schedule step of ``layout`` (one of its gradient-accumulation steps) with per-stage ``costs``, ``latency``
    seconds per cross-rank send and ``overhead`` seconds per action; ``trace`` collects (rank, start, end, action) in
    a dependency order."""
    if layout.pp < 2:
        raise ValueError("a pipeline simulation needs pipeline_parallel_degree >= 2")
    if len(costs) != layout.num_stages:
        raise ValueError(f"{len(costs)} stage costs for {layout.num_stages} stages")
    plan = _compile(layout.schedule, layout.pp, layout.schedule_microbatches, layout.stages_per_rank)
    return _run(plan, costs, latency, overhead, trace)


def rank_work(layout: ScheduleShape, costs: Sequence[StageCost], overhead: float = 0.0) -> tuple[float, ...]:
    """Every rank's work in one schedule step without simulating it: each of its stages runs every microbatch's
    forward and backward (split schedules: input- and weight-gradient halves, one more action's overhead). A
    simulation's rank_busy equals it up to rounding, and no makespan is shorter than the largest: the search's bound
    (plan/search/advisor.py)."""
    actions = 3 if layout.schedule in SPLIT_BACKWARD else 2
    per_stage = [actions * overhead + c.forward + c.backward for c in costs]
    m, p, v = layout.schedule_microbatches, layout.pp, layout.stages_per_rank
    return tuple(m * sum(per_stage[s] for s in stages_of_rank(layout.schedule, p, v, rank)) for rank in range(p))


def simulate_orders(
    orders: Sequence[Sequence[Action]], costs: Sequence[StageCost], latency: float = 0.0, overhead: float = 0.0
) -> StepResult:
    """One step of any schedule given as every rank's actions in order (a CSV schedule, the runtime's own lists);
    ValueError naming the first action that can never start if the orders deadlock."""
    return _run(compile_orders(orders, len(costs)), costs, latency, overhead, None)


def _run(
    plan: _Plan,
    costs: Sequence[StageCost],
    latency: float,
    overhead: float,
    trace: list[tuple[int, float, float, str]] | None,
) -> StepResult:
    stages = len(costs)
    work = [overhead + c.forward for c in costs]
    work += [overhead + c.backward for c in costs]
    work += [overhead + WEIGHT_SHARE * c.backward for c in costs]
    work += [overhead + (1 - WEIGHT_SHARE) * c.backward for c in costs]
    delay = (0.0, latency)
    end, hops = [0.0] * len(plan.steps), [0] * len(plan.steps)
    free, busy, last = [0.0] * plan.ranks, [0.0] * plan.ranks, [-1] * plan.ranks
    for i, (rank, w, d1, x1, d2, x2) in enumerate(plan.steps):
        # start after whichever comes last: the rank's previous action or an input's arrival; follow that one back
        start, sends = free[rank], hops[last[rank]] if last[rank] >= 0 else 0
        if d1 >= 0 and end[d1] + delay[x1] > start:
            start, sends = end[d1] + delay[x1], hops[d1] + x1
        if d2 >= 0 and end[d2] + delay[x2] > start:
            start, sends = end[d2] + delay[x2], hops[d2] + x2
        end[i] = free[rank] = start + work[w]
        hops[i], last[rank] = sends, i
        busy[rank] += work[w]
        if trace is not None:
            kind, s = divmod(w, stages)
            trace.append((rank, start, end[i], spell((kind, s, plan.microbatch[i]))))
    if not end:
        return StepResult(0.0, tuple(busy), 0.0)
    final = max(range(len(end)), key=end.__getitem__)
    return StepResult(end[final], tuple(busy), latency * hops[final])


@dataclass(frozen=True)
class _Plan:
    """A schedule's actions in an order that respects both every rank's order and the dependencies: per action
    (rank, kind x stages + stage, first input's index or -1, 1 if it comes from another rank, second input, ditto)."""

    ranks: int
    steps: tuple[tuple[int, int, int, int, int, int], ...]
    microbatch: tuple[int, ...]


@functools.lru_cache(maxsize=512)
def _compile(schedule: str, p: int, m: int, v: int) -> _Plan:
    """A search evaluates the same schedule shape for many layouts, so its plan is made once per shape."""
    shape = Shape(schedule, p, m, v)
    return compile_orders([rank_order(shape, rank) for rank in range(p)], p * v)


def compile_orders(orders: Sequence[Sequence[Action]], stages: int) -> _Plan:
    """Sweep the ranks, each as far as its next action's inputs are done; ValueError on a deadlock."""
    index: dict[Action, int] = {}  # a full or input-gradient backward is indexed as BACKWARD: both pass dX on
    for rank, order in enumerate(orders):
        _check_order(rank, order, stages)
    steps: list[tuple[int, int, int, int, int, int]] = []
    microbatch: list[int] = []
    position = [0] * len(orders)
    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                kind, s, j = order[position[rank]]
                deps = _inputs(kind, s, j, stages - 1)
                if any(d not in index for d in deps):
                    break
                links = [(index[d], int(steps[index[d]][0] != rank)) for d in deps] + [(-1, 0)] * (2 - len(deps))
                index[(BACKWARD if kind == INPUT else kind, s, j)] = len(steps)
                steps.append((rank, kind * stages + s, *links[0], *links[1]))
                microbatch.append(j)
                position[rank] += 1
                moved = True
    for rank, order in enumerate(orders):
        if position[rank] < len(order):
            raise ConfigError(
                f"the pipeline schedule deadlocks: rank {rank}'s action {position[rank] + 1} "
                f"({spell(order[position[rank]])}) waits for work that never happens; reorder the actions"
            )
    return _Plan(len(orders), tuple(steps), tuple(microbatch))


def _check_order(rank: int, order: Sequence[Action], stages: int) -> None:
    """ValueError for an action outside the stages, one listed twice, or a weight pass after a full backward."""
    seen: set[Action] = set()
    full = {(s, j) for kind, s, j in order if kind == BACKWARD}
    for position, action in enumerate(order, 1):
        kind, s, j = action
        where = f"rank {rank}'s action {position} ({spell(action)})"
        if not 0 <= s < stages:
            raise ConfigError(f"{where} names a stage outside 0 .. {stages - 1}; renumber it")
        if action in seen or (kind == INPUT and (s, j) in full) or (kind == BACKWARD and (INPUT, s, j) in seen):
            raise ConfigError(f"{where} repeats a pass already listed; list each pass once")
        if kind == WEIGHT and (s, j) in full:
            raise ConfigError(f"{where} follows a full backward, which already made the weight gradients; use I and W")
        seen.add(action)


def _inputs(kind: int, s: int, j: int, last: int) -> list[Action]:
    """The actions whose outputs an action consumes (backwards indexed as BACKWARD, full or input half)."""
    if kind == FORWARD:
        return [(FORWARD, s - 1, j)] if s > 0 else []
    if kind in (BACKWARD, INPUT):
        return [(FORWARD, s, j)] + ([(BACKWARD, s + 1, j)] if s < last else [])
    return [(BACKWARD, s, j)]
