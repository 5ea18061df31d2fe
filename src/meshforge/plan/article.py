"""The article's tables (TorchTitan's December-2024 H100 report) as planner inputs, and predicted-vs-published rows.

Each case is the same config overrides `meshforge plan` takes, plus the world size. Readings of what the article leaves
open (docs/planner.md, "Reading the tables"):
- Pipeline microbatches: TorchTitan then defaulted to one microbatch per stage (pp x stages per rank), so local batch
  32 ran as 8 x 4 under 1F1B and 16 x 2 under interleaved 1F1B (2 stages per rank); table 4's batch 8 as 8 x 1.
- Table 4: context parallel grows with the sequence while FSDP x CP = 8 (the report's own rows: FSDP 8/4/2, CP 1/2/4),
  with compile + Float8 + async TP as in the report's title; torch's CP then all-gathered K/V (no ring).
- The code is TorchTitan's (``impl="torchtitan"``): RoPE multiplied complex numbers; selective AC saved every other
  matmul output (as meshforge does).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from meshforge.config.io import load_config
from meshforge.plan.estimate import Estimate, estimate
from meshforge.plan.hardware import HardwareProfile, load_hardware
from meshforge.plan.layout import layout_from_config

_SEQ = "--training.seq_len 8192"
_FAST = "--compile.enable --quantize.dense.float8.enable"
_T1 = f"{_SEQ} --model.flavor 8B --training.local_batch_size 2 --activation_checkpoint.mode selective"
_T2 = (
    f"{_SEQ} {_FAST} --model.flavor 70B --training.local_batch_size 16 --parallelism.tensor_parallel_degree 8 "
    "--activation_checkpoint.mode full"
)
_T3 = (
    f"{_FAST} --model.flavor 405B --parallelism.tensor_parallel_degree 8 --parallelism.pipeline_parallel_degree 8 "
    "--parallelism.enable_async_tensor_parallel --activation_checkpoint.mode full"
)
_PP = "--parallelism.pipeline_parallel_schedule {} --parallelism.pipeline_parallel_microbatch_size {}"


@dataclass(frozen=True)
class Case:
    """One published row: the setup as overrides, and TPS/GPU + peak memory (GiB) as published."""

    table: int
    name: str
    world_size: int
    overrides: tuple[str, ...]
    tps: float
    memory_gib: float


def _case(table: int, name: str, world: int, args: str, tps: float, mem: float) -> Case:
    return Case(table, name, world, tuple(args.split()), tps, mem)


def _t4(seq: int, cp: int, tps: float, mem: float) -> Case:
    args = f"{_T3} --training.seq_len {seq} --training.local_batch_size 8 --parallelism.context_parallel_degree {cp} "
    args += "--parallelism.context_parallel_impl allgather " + _PP.format("1F1B", 1)
    return _case(4, f"405B 4D seq {seq} (FSDP {8 // cp}, CP {cp})", 512, args, tps, mem)


CASES: tuple[Case, ...] = (
    _case(1, "8B FSDP", 8, _T1, 5762, 82.4),
    _case(1, "8B FSDP + compile", 8, f"{_T1} --compile.enable", 6667, 77.0),
    _case(1, "8B FSDP + compile + Float8", 8, f"{_T1} {_FAST}", 8532, 76.8),
    _case(2, "70B FSDP 32 x TP 8", 256, _T2, 829, 71.9),
    _case(2, "70B FSDP 32 x TP 8 + async TP", 256, f"{_T2} --parallelism.enable_async_tensor_parallel", 876, 67.6),
    _case(3, "405B 3D 1F1B", 512, f"{_T3} {_SEQ} --training.local_batch_size 32 {_PP.format('1F1B', 4)}", 100, 82.5),
    _case(
        3,
        "405B 3D interleaved 1F1B",
        512,
        f"{_T3} {_SEQ} --training.local_batch_size 32 {_PP.format('Interleaved1F1B', 2)}",
        128,
        72.7,
    ),
    _t4(32768, 1, 76, 75.3),
    _t4(65536, 2, 47, 75.9),
    _t4(131072, 4, 31, 77.1),
)


def _cp8b(seq: int, cp: int, tps: float, mem: float) -> Case:
    args = f"{_FAST} --model.flavor 8B --training.seq_len {seq} --training.local_batch_size 1 "
    args += f"--activation_checkpoint.mode full --parallelism.context_parallel_degree {cp} "
    return _case(
        0,
        f"8B CP seq {seq} (FSDP {8 // cp}, CP {cp})",
        8,
        args + "--parallelism.context_parallel_impl allgather",
        tps,
        mem,
    )


_T405_2D = f"{_SEQ} --model.flavor 405B --training.local_batch_size 2 --parallelism.tensor_parallel_degree 8 " + (
    "--activation_checkpoint.mode full"
)
HOLDOUT: tuple[Case, ...] = (
    # The same report's rows the article leaves out (its tables 2, 3 and 6's last row), and the 405B 2D rows of the
    # report's previous version (128 GPUs, memory not given: 0). Never used to fit a constant; table = 0.
    _case(0, "8B FSDP 128 GPUs", 128, _T1, 5605, 67.0),
    _case(0, "8B FSDP + compile, 128 GPUs", 128, f"{_T1} --compile.enable", 6514, 62.0),
    _case(0, "8B FSDP + compile + Float8, 128 GPUs", 128, f"{_T1} {_FAST}", 8380, 61.8),
    _cp8b(32768, 1, 3890, 83.9),
    _cp8b(65536, 2, 2540, 84.2),
    _cp8b(131072, 4, 1071, 84.0),
    _cp8b(262144, 8, 548, 84.5),
    replace(_t4(262144, 8, 16, 84.9), table=0),
    _case(0, "405B FSDP 16 x TP 8, 128 GPUs", 128, _T405_2D, 109, 0.0),
    _case(0, "405B 2D + compile + Float8, 128 GPUs", 128, f"{_T405_2D} {_FAST}", 177, 0.0),
    _case(
        0,
        "405B 2D + Float8 + async TP, 128 GPUs",
        128,
        f"{_T405_2D} {_FAST} --parallelism.enable_async_tensor_parallel",
        185,
        0.0,
    ),
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
    def memory_error(self) -> float | None:
        """None where the source gives no memory."""
        return self.estimate.peak_memory_gib / self.case.memory_gib - 1 if self.case.memory_gib else None


def predict(case: Case, hw: HardwareProfile) -> Estimate:
    """The planner's prediction for one published setup (through the same config path as the CLI)."""
    cfg = load_config(None, list(case.overrides))
    return estimate(layout_from_config(cfg, case.world_size, impl=ARTICLE_IMPL), hw)


def reproduce(hw: HardwareProfile | None = None, cases: tuple[Case, ...] = CASES) -> list[Row]:
    """Every published row with the planner's prediction on the article's hardware (h100-96gb by default)."""
    hw = hw or load_hardware("h100-96gb")
    return [Row(case, predict(case, hw)) for case in cases]


def summary(rows: list[Row]) -> dict[str, float]:
    """Median and maximum absolute relative errors of TPS and memory."""
    tps = [abs(r.tps_error) for r in rows]
    mem = [abs(r.memory_error) for r in rows if r.memory_error is not None]
    return {
        "tps_median": statistics.median(tps),
        "tps_max": max(tps),
        "memory_median": statistics.median(mem),
        "memory_max": max(mem),
    }


def format_rows(rows: list[Row]) -> str:
    """The predicted-vs-published table as Markdown."""
    lines = [
        "| table | setup | TPS/GPU published | predicted | error | memory GiB published | predicted | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        c, e, m = row.case, row.estimate, row.memory_error
        published = f"{c.memory_gib:.1f}" if m is not None else "-"
        lines.append(
            f"| {c.table or 'holdout'} | {c.name} | {c.tps:,.0f} | {e.tps_per_device:,.0f} | {row.tps_error:+.1%} | "
            f"{published} | {e.peak_memory_gib:.1f} | {'-' if m is None else f'{m:+.1%}'} |"
        )
    s = summary(rows)
    lines.append(
        f"\nmedian |error|: TPS {s['tps_median']:.1%}, memory {s['memory_median']:.1%}; "
        f"max: TPS {s['tps_max']:.1%}, memory {s['memory_max']:.1%}"
    )
    return "\n".join(lines)
