"""The pipeline bubble: each rank's measured idle share of a pipeline step, and what the schedule predicts.

Measured: a ``BusyClock`` times every compute action of a rank's stages (forward, full / input / weight backward and the
loss) and the whole ``schedule.step``; idle share = 1 - busy / step time. Waiting for a neighbour's activations or
gradients is the only other thing a rank does inside a step, so this is the bubble. On CUDA the compute sections are
timed with events on the current stream (host timers would only see kernel launches).

Theory: GPipe and 1F1B idle (p-1)/(m+p-1) of a step (p ranks, m microbatches). Multi-stage schedules (interleaved,
looped, zero-bubble, V-shaped, CSV) are simulated from the very action lists the runtime executes, with unit costs
forward 1, input-backward 1, weight-backward 1, full backward 2 and free communication; interleaved 1F1B with v stages
per rank then gives about (p-1)/(v m + p-1), ZBV about zero.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from meshforge.device.collectives import collective_tensor
from meshforge.model.moe import load_counting_paused
from meshforge.parallel.pipeline import simulator

Action = tuple[int, str, int]
"""(stage index, kind F/B/I/W, microbatch index)."""
COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Unit costs; a split backward's halves are each half a full one (simulator.WEIGHT_SHARE)."""
KINDS = {"F": simulator.FORWARD, "B": simulator.BACKWARD, "I": simulator.INPUT, "W": simulator.WEIGHT}


class BusyClock:
    """Accumulates one rank's compute time and pipeline-step time since the last ``take``.

    On CUDA nothing waits for the device inside a step: compute sections and whole steps are bracketed by timing
    events on the current stream, read in :meth:`take` (a log step) after one wait for the last event, so training
    steps carry no host synchronisation (tests/unit/test_pipeline_split.py counts them)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.busy_s = 0.0
        self.step_s = 0.0
        self._events: list[tuple[Any, Any, bool]] = []  # (start, end, is a whole step) CUDA events since the take
        self._depth = 0

    def _record(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Time a compute section (nested sections count once)."""
        self._depth += 1
        outer = self._depth == 1
        start = time.perf_counter()
        begin = self._record() if outer and self.cuda else None
        try:
            yield
        finally:
            self._depth -= 1
            if outer and self.cuda:
                self._events.append((begin, self._record(), False))
            elif outer:
                self.busy_s += time.perf_counter() - start

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time one whole pipeline step (on CUDA: device time between events around it, read at ``take``)."""
        start = time.perf_counter()
        begin = self._record() if self.cuda else None
        try:
            yield
        finally:
            if self.cuda:
                self._events.append((begin, self._record(), True))
            else:
                self.step_s += time.perf_counter() - start

    def _read_events(self) -> None:
        if self._events:
            self._events[-1][1].synchronize()  # the one wait: every earlier event has completed too
            for begin, end, whole in self._events:
                seconds = begin.elapsed_time(end) / 1000
                if whole:
                    self.step_s += seconds
                else:
                    self.busy_s += seconds
            self._events.clear()

    def take(self) -> float:
        """Idle share of the steps since the last call (0 when no step ran), then reset."""
        self._read_events()
        idle = 1.0 - self.busy_s / self.step_s if self.step_s > 0 else 0.0
        self.busy_s = self.step_s = 0.0
        return max(0.0, idle)


class TimedPipelineStage(PipelineStage):
    """A ``PipelineStage`` whose compute actions are timed by a ``BusyClock``."""

    def __init__(self, *args: Any, clock: BusyClock, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        """Shape inference runs the stage on placeholder tensors: MoE layers must not count those tokens."""
        with load_counting_paused(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.busy():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        with self.clock.busy():
            super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        with self.clock.busy():
            super().backward_weight_one_chunk(*args, **kwargs)


def idle_shares_by_pp_rank(clock: BusyClock, pp_group: dist.ProcessGroup) -> list[float]:
    """Every pipeline rank's idle share since the last call (collective over the pipeline group)."""
    mine = collective_tensor([clock.take()], pp_group)
    shares = [torch.zeros_like(mine) for _ in range(dist.get_world_size(pp_group))]
    dist.all_gather(shares, mine, group=pp_group)
    return [float(s.item()) for s in shares]


def single_stage_theory(pp: int, n_microbatches: int) -> float:
    """GPipe / 1F1B: each rank idles (p-1) of the (m+p-1) forward+backward slots."""
    return (pp - 1) / (n_microbatches + pp - 1)


def simulate_idle_shares(order: dict[int, list[Action | None]], num_stages: int) -> list[float]:
    """Idle share of each rank when its actions run in order with unit costs (see the module docstring), by the
    planner's simulator (parallel.pipeline.simulator), which the planner's tests check against torch's schedules.

    Raises ValueError naming the rank and position of the first action that can never start (a deadlock)."""
    ranks = sorted(order)
    orders = [[(KINDS[kind], stage, mb) for stage, kind, mb in filter(None, order[r])] for r in ranks]
    result = simulator.simulate_orders(orders, [simulator.StageCost(COST["F"], COST["B"])] * num_stages)
    return [1.0 - busy / result.makespan if result.makespan else 0.0 for busy in result.rank_busy]


def compute_actions(order: dict[int, list[Any]]) -> dict[int, list[Action | None]]:
    """torch's schedule IR (``_Action`` lists, OVERLAP_F_B expanded) -> plain (stage, kind, microbatch) tuples."""
    out: dict[int, list[Action | None]] = {}
    for rank, actions in order.items():
        row: list[Action | None] = []
        for action in actions:
            if action is None:
                continue
            for sub in action.sub_actions or (action,):
                kind = sub.computation_type.value
                if kind in COST:
                    row.append((sub.stage_index, kind, sub.microbatch_index))
        out[rank] = row
    return out
