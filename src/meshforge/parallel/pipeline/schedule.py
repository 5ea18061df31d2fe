"""Pipeline schedules: names -> torch.distributed.pipelining classes, the microbatch rules of each, and CSV schedules.

CSV format (docs/pipeline.md): one line per pipeline rank, in rank order; each cell one compute action
``<stage><F|B|I|W><microbatch>`` (``2F0``: stage 2 forward of microbatch 0; B full backward, I input-gradient backward,
W weight-gradient backward), run left to right; an empty cell is an idle slot. Stages belong to the rank whose line
names them. Every stage runs F, then B (or I then W), once per microbatch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule, _PipelineScheduleRuntime
from torch.distributed.pipelining.stage import PipelineStage

from meshforge.errors import ConfigError
from meshforge.parallel.pipeline import rules
from meshforge.parallel.pipeline.bubble import Action, simulate_idle_shares
from meshforge.parallel.pipeline.catalog import SCHEDULE_STYLES, Style

ScheduleClass = Callable[..., _PipelineSchedule]
TORCH_CLASSES: dict[str, ScheduleClass] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}
_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True)
class ScheduleSpec:
    """What the rest of the pipeline needs to know about the chosen schedule."""

    name: str
    cls: ScheduleClass
    style: Style
    split_backward: bool
    csv: CsvSchedule | None = None


@dataclass(frozen=True)
class CsvSchedule:
    """A schedule read from a CSV file: per-rank compute actions and the stage -> rank map they imply."""

    path: str
    actions: dict[int, list[Action | None]]
    stage_rank: dict[int, int]
    n_microbatches: int
    split_backward: bool = field(default=False)


def schedule_spec(name: str, csv_path: str, pp: int) -> ScheduleSpec:
    """The schedule to run: the CSV file when given, else the named one."""
    if csv_path:
        csv = read_csv_schedule(csv_path, pp)
        return ScheduleSpec(f"CSV {csv_path}", _PipelineScheduleRuntime, "loop", csv.split_backward, csv)
    canonical = rules.resolve_schedule_name(name)
    style, split = SCHEDULE_STYLES[canonical]
    return ScheduleSpec(canonical, TORCH_CLASSES[canonical], style, split)


def check_microbatches(spec: ScheduleSpec, n_microbatches: int, pp: int, num_stages: int) -> None:
    """A CSV schedule's microbatches are the step's; a named schedule's follow torch's rules (pipeline/rules.py)."""
    if spec.csv is None:
        rules.check_microbatches(spec.name, n_microbatches, pp, num_stages)
    elif spec.csv.n_microbatches != n_microbatches:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule_csv = {spec.csv.path} schedules {spec.csv.n_microbatches} "
            f"microbatches but the step has {n_microbatches} microbatches (local batch / microbatch size); make them "
            "equal"
        )


def read_csv_schedule(path: str, pp: int) -> CsvSchedule:
    """Parse and check a CSV schedule; every error names the file and the line."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"parallelism.pipeline_parallel_schedule_csv = {path}: no such file; give a CSV schedule")
    lines = file.read_text().splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if len(lines) != pp:
        raise ConfigError(
            f"{path}: {len(lines)} lines but pipeline_parallel_degree = {pp}; write one line of actions per rank"
        )
    actions: dict[int, list[Action | None]] = {}
    stage_rank: dict[int, int] = {}
    for rank, line in enumerate(lines):
        actions[rank] = [_parse_cell(path, rank, col, cell, stage_rank) for col, cell in enumerate(line.split(","))]
    num_stages = len(stage_rank)
    if sorted(stage_rank) != list(range(num_stages)):
        raise ConfigError(f"{path}: stages {sorted(stage_rank)} are not numbered 0 .. n-1; renumber them")
    empty = [r for r in range(pp) if r not in stage_rank.values()]
    if empty:
        raise ConfigError(f"{path}: line {empty[0] + 1} (rank {empty[0]}) runs no stage; give every rank a stage")
    n_microbatches = _check_actions(path, actions, num_stages)
    simulate_idle_shares(actions, num_stages)  # raises on a deadlock
    split = any(a is not None and a[1] in "IW" for row in actions.values() for a in row)
    return CsvSchedule(path, actions, stage_rank, n_microbatches, split)


def _parse_cell(path: str, rank: int, col: int, cell: str, stage_rank: dict[int, int]) -> Action | None:
    text = cell.strip()
    if not text:
        return None
    match = _ACTION.match(text)
    where = f"{path} line {rank + 1}, column {col + 1}"
    if match is None:
        raise ConfigError(f"{where}: {text!r} is not a compute action like 0F0, 1B2, 0I1 or 0W1; fix the cell")
    stage, kind, mb = int(match[1]), match[2], int(match[3])
    owner = stage_rank.setdefault(stage, rank)
    if owner != rank:
        raise ConfigError(f"{where}: stage {stage} already runs on line {owner + 1}; a stage belongs to one rank")
    return stage, kind, mb


def _check_actions(path: str, actions: dict[int, list[Action | None]], num_stages: int) -> int:
    """Order and completeness per stage; returns the number of microbatches."""
    seen: dict[tuple[int, str], set[int]] = {(s, k): set() for s in range(num_stages) for k in "FBIW"}
    need = {"B": "F", "I": "F", "W": "I"}
    for rank, row in actions.items():
        for col, action in enumerate(row):
            if action is None:
                continue
            stage, kind, mb = action
            where = f"{path} line {rank + 1}, column {col + 1} ({stage}{kind}{mb})"
            if mb in seen[(stage, kind)]:
                raise ConfigError(f"{where}: runs twice; each action happens once per microbatch")
            if kind in need and mb not in seen[(stage, need[kind])]:
                raise ConfigError(f"{where}: comes before {stage}{need[kind]}{mb} on its line; move it after")
            if kind in "BI" and mb in seen[(stage, "I" if kind == "B" else "B")]:
                raise ConfigError(f"{where}: microbatch {mb} has both B and I; use B, or I then W")
            seen[(stage, kind)].add(mb)
    n_microbatches = len(seen[(0, "F")])
    for stage in range(num_stages):
        forwards, backwards = seen[(stage, "F")], seen[(stage, "B")] | seen[(stage, "W")]
        if forwards != set(range(n_microbatches)) or backwards != forwards or seen[(stage, "I")] != seen[(stage, "W")]:
            line = next(r for r, row in actions.items() if any(a and a[0] == stage for a in row)) + 1
            raise ConfigError(
                f"{path} line {line}: stage {stage} must run F and then B (or I and W) for each of microbatches "
                f"0 .. {n_microbatches - 1} exactly once (F {sorted(forwards)}, backward {sorted(backwards)})"
            )
    return n_microbatches


def build_schedule(
    spec: ScheduleSpec, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Callable[..., torch.Tensor]
) -> _PipelineSchedule:
    """The torch schedule object over this rank's stages (loss already scaled, so no gradient rescaling)."""
    if spec.style == "single" and spec.csv is None:
        return spec.cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule = spec.cls(list(stages), n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if spec.csv is not None:
        assert isinstance(schedule, _PipelineScheduleRuntime)
        schedule._load_csv(spec.csv.path, format="compute_only")
    return schedule
