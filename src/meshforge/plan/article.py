"""The article's tables (TorchTitan's December-2024 H100 report) as planner inputs, and predicted-vs-published rows.

Each case is the same config overrides `meshforge plan` takes, plus the world size. Readings of what the article leaves
open (docs/planner.md, "Reading the tables"):
- Pipeline microbatches: TorchTitan then defaulted to one microbatch per stage (pp x stages per rank), so local batch
  32 ran as 8 x 4 under 1F1B and 16 x 2 under interleaved 1F1B (2 stages per rank); table 4's batch 8 as 8 x 1.
- Table 4: context parallel grows with the sequence while FSDP x CP = 8 (the report's own rows: FSDP 8/4/2, CP 1/2/4),
  with compile + Float8 + async TP as in the report's title; torch's CP then all-gathered K/V (no ring).
- The code is TorchTitan's (``impl="torchtitan"``): selective AC saved every other matmul output (meshforge saves all
  of them) and RoPE multiplied complex numbers.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from meshforge.config_io import load_config
from meshforge.plan.estimate import Estimate, estimate
from meshforge.plan.hardware import HardwareProfile, load_hardware
from meshforge.plan.layout import layout_from_config

_COMMON = ["--training.seq_len", "8192"]
_T1 = [*_COMMON, "--model.flavor", "8B", "--training.local_batch_size", "2",
       "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
_FAST = ["--compile.enable", "--quantize.dense.float8.enable"]
_T2 = [*_COMMON, *_FAST, "--model.flavor", "70B", "--training.local_batch_size", "16",
       "--parallelism.tensor_parallel_degree", "8", "--activation_checkpoint.mode", "full"]
_T3 = [*_FAST, "--model.flavor", "405B", "--parallelism.tensor_parallel_degree", "8",
       "--parallelism.pipeline_parallel_degree", "8", "--parallelism.enable_async_tensor_parallel",
       "--activation_checkpoint.mode", "full"]


@dataclass(frozen=True)
class Case:
    """One published row: the setup as overrides, and TPS/GPU + peak memory (GiB) as published."""

    table: int
    name: str
    world_size: int
    overrides: tuple[str, ...]
    tps: float
    memory_gib: float


def _t4(seq: int, cp: int, tps: float, mem: float) -> Case:
    return Case(4, f"405B 4D seq {seq} (FSDP {8 // cp}, CP {cp})", 512, (
        *_T3, "--training.seq_len", str(seq), "--training.local_batch_size", "8",
        "--parallelism.context_parallel_degree", str(cp), "--parallelism.context_parallel_impl", "allgather",
        "--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "1"),
        tps, mem)


CASES: tuple[Case, ...] = (
    Case(1, "8B FSDP", 8, tuple(_T1), 5762, 82.4),
    Case(1, "8B FSDP + compile", 8, (*_T1, "--compile.enable"), 6667, 77.0),
    Case(1, "8B FSDP + compile + Float8", 8, (*_T1, *_FAST), 8532, 76.8),
    Case(2, "70B FSDP 32 x TP 8", 256, tuple(_T2), 829, 71.9),
    Case(2, "70B FSDP 32 x TP 8 + async TP", 256, (*_T2, "--parallelism.enable_async_tensor_parallel"), 876, 67.6),
    Case(3, "405B 3D 1F1B", 512, (*_T3, *_COMMON, "--training.local_batch_size", "32",
         "--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "4"),
         100, 82.5),
    Case(3, "405B 3D interleaved 1F1B", 512, (*_T3, *_COMMON, "--training.local_batch_size", "32",
         "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
         "--parallelism.pipeline_parallel_microbatch_size", "2"), 128, 72.7),
    _t4(32768, 1, 76, 75.3),
    _t4(65536, 2, 47, 75.9),
    _t4(131072, 4, 31, 77.1),
)
ARTICLE_IMPL = "torchtitan"


@dataclass(frozen=True)
class Row:
    case: Case
    estimate: Estimate

    @property
    def tps_error(self) -> float:
        return self.estimate.tps_per_device / self.case.tps - 1

    @property
    def memory_error(self) -> float:
        return self.estimate.peak_memory_gib / self.case.memory_gib - 1


def predict(case: Case, hw: HardwareProfile) -> Estimate:
    """The planner's prediction for one published setup (through the same config path as the CLI)."""
    cfg = load_config(None, list(case.overrides))
    return estimate(layout_from_config(cfg, case.world_size, impl=ARTICLE_IMPL), hw)


def reproduce(hw: HardwareProfile | None = None) -> list[Row]:
    """Every published row with the planner's prediction on the article's hardware (h100-96gb by default)."""
    hw = hw or load_hardware("h100-96gb")
    return [Row(case, predict(case, hw)) for case in CASES]


def summary(rows: list[Row]) -> dict[str, float]:
    """Median and maximum absolute relative errors of TPS and memory."""
    tps = [abs(r.tps_error) for r in rows]
    mem = [abs(r.memory_error) for r in rows]
    return {"tps_median": statistics.median(tps), "tps_max": max(tps),
            "memory_median": statistics.median(mem), "memory_max": max(mem)}


def format_rows(rows: list[Row]) -> str:
    """The predicted-vs-published table as Markdown."""
    lines = ["| table | setup | TPS/GPU published | predicted | error | memory GiB published | predicted | error |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        c, e = row.case, row.estimate
        lines.append(f"| {c.table} | {c.name} | {c.tps:,.0f} | {e.tps_per_device:,.0f} | {row.tps_error:+.1%} | "
                     f"{c.memory_gib:.1f} | {e.peak_memory_gib:.1f} | {row.memory_error:+.1%} |")
    s = summary(rows)
    lines.append(f"\nmedian |error|: TPS {s['tps_median']:.1%}, memory {s['memory_median']:.1%}; "
                 f"max: TPS {s['tps_max']:.1%}, memory {s['memory_max']:.1%}")
    return "\n".join(lines)
