"""`meshforge train --dry-run --memory [--json]`: the dry run's checks and layout, then the exact fake-tensor peak.

Options the fake-tensor step cannot run are swapped for eager bf16 equivalents with a note each: torch.compile (the
step runs eager; compiled fusions change temporaries, mostly down) and Float8 on a CUDA target (bf16 matmuls; the
Float8 weight casts are temporaries of one block)."""

from __future__ import annotations

import dataclasses
import json
import sys

from meshforge.config.schema import JobConfig
from meshforge.errors import ConfigError
from meshforge.model.hf_config import resolve_model_args
from meshforge.tools.dry_run import DryRun, format_report, plan
from meshforge.tools.memory_ops import SavedByOp, format_by_op, saved_by_op
from meshforge.tools.memory_pp import pp_memory_run
from meshforge.tools.memory_run import MemoryRun, format_memory, memory_run


def runnable(cfg: JobConfig, report: DryRun) -> tuple[JobConfig, list[str]]:
    """The config as the fake-tensor step runs it (module docstring) and the notes saying what changed."""
    notes = []
    dtype = report_dtype(cfg, report)
    training = dataclasses.replace(cfg.training, mixed_precision_param=dtype)  # type: ignore[arg-type]
    cfg = dataclasses.replace(cfg, training=training)
    if cfg.compile.enable:
        notes.append("compile.enable: the memory step runs eager (compiled fusions change temporaries)")
        cfg = dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, enable=False))
    float8 = cfg.quantize.dense.float8
    if float8.enable:
        notes.append("Float8: the memory step runs bf16 matmuls (Float8 casts are per-block temporaries)")
        dense = dataclasses.replace(cfg.quantize.dense, float8=dataclasses.replace(float8, enable=False))
        cfg = dataclasses.replace(cfg, quantize=dataclasses.replace(cfg.quantize, dense=dense))
    return cfg, notes


def report_dtype(cfg: JobConfig, report: DryRun) -> str:
    """training.mixed_precision_param as the dry run resolved it for the target (auto -> bf16 on CUDA)."""
    if cfg.training.mixed_precision_param != "auto":
        return cfg.training.mixed_precision_param
    return "bfloat16" if report.target == "cuda" else "float32"


def exact_memory(cfg: JobConfig, world_size: int) -> tuple[DryRun, MemoryRun]:
    """The dry run's report and rank 0's exact peak (the planner's cross-check calls this)."""
    report = plan(cfg, world_size)
    step_cfg, notes = runnable(cfg, report)
    args = resolve_model_args(step_cfg.model, step_cfg.training.seq_len)
    measure = pp_memory_run if report.dims.pp > 1 else memory_run  # a pipeline: its busiest stage (memory_pp.py)
    run = measure(step_cfg, world_size, args, report.dims)
    run.notes += notes
    return report, run


def exact_saves(cfg: JobConfig, world_size: int) -> tuple[DryRun, SavedByOp, list[str]]:
    """The dry run's report, rank 0's saved activations of one block-micro-batch by op (tools/memory_ops.py) and
    the notes on what the step changed."""
    report = plan(cfg, world_size)
    step_cfg, notes = runnable(cfg, report)
    args = resolve_model_args(step_cfg.model, step_cfg.training.seq_len)
    if step_cfg.activation_checkpoint.mode != "none":
        notes.append(
            f"activation_checkpoint.mode = {step_cfg.activation_checkpoint.mode}: the checkpoint holds what its "
            "regions save, --by-op sees only the rest (mode none shows every save)"
        )
    return report, saved_by_op(step_cfg, world_size, args, report.dims), notes


def dry_run_memory(
    cfg: JobConfig, world_size: int, *, as_json: bool = False, peak: bool = True, by_op: bool = False
) -> int:
    """Print the layout, the exact peak by category (``peak``) and the saved activations by op (``by_op``), and
    with ``as_json`` one JSON record; 0, or 2 with one line."""
    try:
        report, run = exact_memory(cfg, world_size) if peak else (plan(cfg, world_size), None)
        saves = exact_saves(cfg, world_size) if by_op else None
    except ConfigError as exc:
        print(f"meshforge train --dry-run --memory: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    record: dict[str, object] = {"flavor": report.flavor, "world_size": world_size, "layout": str(report.dims)}
    if run is not None:
        print(format_memory(run))
        record.update(run.record())
    if saves is not None:
        print(format_by_op(saves[1]))
        for note in saves[2]:
            print(f"note: {note}")
        record["saved_by_op"] = saves[1].record()
    if as_json:
        print(json.dumps(record))
    return 0
