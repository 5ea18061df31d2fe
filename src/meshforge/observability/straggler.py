"""Straggler detection: on log steps only, one all-gather of every rank's per-step time parts averaged over the
interval; a rank whose data loading, forward-backward or optimizer time exceeds that part's median by more than
``metrics.straggler_threshold`` x the median step time for 3 consecutive intervals is named in one line and in
metrics.jsonl (``stragglers``).

What is timed, without a profiler: data loading in wall time (it has no collectives, so it is this rank's own
time); forward-backward and the optimizer in process CPU time (``time.process_time``), because collectives are
synchronous: a rank that waits for a slow peer inside FSDP's all-gather spends that wall time waiting, not
computing, and would look slow itself in wall time. The difference wall - CPU of those two parts is logged as
``wait`` (time in collectives, plus time the OS gave the core to another process); it is shown, not used to name a
rank (the waiting rank is the victim). On CUDA the CPU time of forward-backward is the host's launch work only:
compute stragglers on a GPU need CUDA events, which this does not add (data and host stragglers are still found).

The excess is compared with the median step time, not with the part itself (a part of 2 ms that takes 3 ms on one
rank is noise, not a straggler). The same gather carries one more value from rank 0, so a decision every rank must
share (a save due by wall time, train/elastic.py) travels without a collective of its own.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from meshforge.device.collectives import collective_tensor

PARTS = ("data", "fwd_bwd", "optimizer")  # compared across ranks; "wait" (the 4th value) is shown only
CONSECUTIVE = 3  # intervals a rank must stay slow before it is named


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


@dataclass
class StepTimes:
    """Per-part seconds summed over the current interval on this rank; ``begin``, ``split`` (after the micro-steps)
    and ``end`` (after the optimizer) are called by the training step."""

    data: float = 0.0
    fwd_bwd: float = 0.0
    optimizer: float = 0.0
    wait: float = 0.0
    steps: int = 0
    _mark: tuple[float, float] = (0.0, 0.0)

    def begin(self) -> None:
        self._mark = _clocks()

    def split(self, data_seconds: float) -> None:
        """Forward-backward ends; ``data_seconds`` of wall time went to data loading."""
        wall, cpu = self._lap()
        self.data += data_seconds
        self.fwd_bwd += cpu  # includes the loader's own CPU work (small; a CPU-bound loader is then seen twice)
        self.wait += max(0.0, wall - data_seconds - cpu)

    def end(self) -> None:
        """The optimizer step ends."""
        wall, cpu = self._lap()
        self.optimizer += cpu
        self.wait += max(0.0, wall - cpu)
        self.steps += 1

    def _lap(self) -> tuple[float, float]:
        now = _clocks()
        (wall0, cpu0), self._mark = self._mark, now
        return now[0] - wall0, now[1] - cpu0

    def per_step(self) -> list[float]:
        n = max(self.steps, 1)
        return [self.data / n, self.fwd_bwd / n, self.optimizer / n, self.wait / n]


def find_stragglers(rows: list[list[float]], threshold: float) -> dict[int, str]:
    """Ranks (index into ``rows``, each [data, fwd_bwd, optimizer, wait] seconds per step) slower than the median of
    a part (not wait) by more than ``threshold`` x the median step time (all four), with a phrase saying where."""
    if len(rows) < 2:
        return {}
    step = statistics.median(sum(r[: len(PARTS) + 1]) for r in rows)
    if step <= 0:
        return {}
    slow: dict[int, str] = {}
    for p, name in enumerate(PARTS):
        median = statistics.median(r[p] for r in rows)
        for rank, r in enumerate(rows):
            excess = r[p] - median
            if excess > threshold * step and rank not in slow:
                slow[rank] = (
                    f"{name} {r[p]:.3f} s/step vs median {median:.3f} s (+{100 * excess / step:.0f} % of the median "
                    f"step time {step:.3f} s)"
                )
    return slow


@dataclass
class StragglerDetector:
    """Counts consecutive slow intervals per rank; ``observe`` is collective on log steps (one all-gather)."""

    threshold: float
    console: bool
    times: StepTimes = field(default_factory=StepTimes)
    streak: dict[int, int] = field(default_factory=dict)
    gathers: int = 0  # all-gathers done (the test checks none happen on other steps)

    def observe(self, step: int, flag: float = 0.0) -> tuple[dict[str, Any], float]:
        """Gather every rank's interval parts plus ``flag`` (rank 0's counts); returns the metrics to log and rank
        0's flag. Resets the interval."""
        mine = self.times.per_step()
        self.times = StepTimes()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return {}, flag
        world = dist.get_world_size()
        local = collective_tensor([*mine, flag])
        gathered = [local.clone() for _ in range(world)]
        dist.all_gather(gathered, local)
        self.gathers += 1
        rows = [t.tolist() for t in gathered]
        slow = find_stragglers([r[:-1] for r in rows], self.threshold) if self.threshold > 0 else {}
        self.streak = {rank: self.streak.get(rank, 0) + 1 for rank in slow}
        named = sorted(rank for rank, n in self.streak.items() if n >= CONSECUTIVE)
        for rank in named:
            if self.streak[rank] == CONSECUTIVE and self.console:
                print(
                    f"meshforge: straggler: rank {rank} at step {step}, slow for {CONSECUTIVE} log intervals: "
                    f"{slow[rank]} (metrics.straggler_threshold = {self.threshold})",
                    file=sys.stdout,
                    flush=True,
                )
        record: dict[str, Any] = {"wait_max_s": max(r[len(PARTS)] for r in rows)}
        if named:
            record["stragglers"] = named
        return record, float(rows[0][-1])
