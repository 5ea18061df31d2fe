"""Production-scale layouts large labs published for their own pre-training: a held-out set, never fitted.

Source: Llama Team, AI @ Meta, "The Llama 3 Herd of Models", arXiv:2407.21783 (July 2024), section 3.3.2 and Table 4
("Scaling configurations and MFU for each stage of Llama 3 405B pre-training"): 405B on H100 SXM 80 GB (700 W, 8 per
Grand Teton host, NVLink inside, 400 Gb/s RoCE between), BF16, with TP 8, PP 16 and CP 16 for the long-context stage;
the same figures were shown at SC'24 (P. Balaji, "Herding Llamas", quoted at https://glennklockwood.com/garden/llama-3.1).

| GPUs | TP | CP | PP | DP | seq | batch / DP | tokens / batch | TFLOPs / GPU | BF16 MFU |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| 8,192 | 8 | 1 | 16 | 64 | 8,192 | 32 | 16M | 430 | 43 % |
| 16,384 | 8 | 1 | 16 | 128 | 8,192 | 16 | 16M | 400 | 41 % |
| 16,384 | 8 | 16 | 16 | 8 | 131,072 | 16 | 16M | 380 | 38 % |

What the paper leaves open, and how the rows read it (``READING``): its own code (not TorchTitan's), read as
TorchTitan's (``impl = "torchtitan"``: the implementation the constants were fitted on); its pipeline schedule is an
interleaved 1F1B with a tunable number of microbatches, read as Interleaved1F1B, 2 stages per rank (TorchTitan's
default), microbatch size 1 (one sequence), the first and last stage one layer short (the paper balances them so);
FSDP shards optimizer states and gradients without resharding the weights after forward (what meshforge's FSDP does
under pipeline parallel); no Float8 (BF16 figures); activation checkpointing: the paper trains 8K sequences without
it, which in this model needs 275 GiB (selective per-op: 110 GiB), so full AC, the one mode that fits 80 GB here;
context parallel all-gathers K/V (the paper's CP, section 3.3.2) before their repeat to the query heads: the paper
gives GQA's small K/V as the reason the all-gather's latency stays small (``Layout.cp_gathers_gqa_kv``; TorchTitan's
model repeats them first, and the published rows keep that).
The hardware is the ``h100`` preset. The paper counts TFLOPs/GPU as model FLOPs (its MFU is against 989 TFLOP/s), as
``Estimate.mfu_pct`` does, so predicted TFLOPs/GPU = MFU x 989.4.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshforge.config.io import load_config
from meshforge.plan.estimate import Estimate, estimate
from meshforge.plan.hardware import HardwareProfile, load_hardware
from meshforge.plan.layout import layout_from_config

SOURCE = "Llama Team, AI @ Meta, The Llama 3 Herd of Models, arXiv:2407.21783, Table 4"
READING = (
    "impl torchtitan; Interleaved1F1B, 2 stages per rank, microbatch 1; full AC (not stated); BF16; CP all-gathers "
    "the GQA K/V (kv_heads)"
)
TOLERANCE = 0.15
"""The bar: predicted TFLOPs/GPU within 15 % of the published figure."""


@dataclass(frozen=True)
class HeldOut:
    """One published production layout: its setup as config overrides, world size, hardware, TFLOPs/GPU."""

    key: str
    name: str
    world_size: int
    overrides: tuple[str, ...]
    tflops_per_gpu: float
    hardware: str = "h100"


_BASE = (
    "--model.flavor 405B --parallelism.tensor_parallel_degree 8 --parallelism.pipeline_parallel_degree 16 "
    "--parallelism.pipeline_parallel_schedule Interleaved1F1B --parallelism.pipeline_parallel_microbatch_size 1 "
    "--activation_checkpoint.mode full"
)

ROWS: tuple[HeldOut, ...] = (
    HeldOut(
        "llama3.405b_8k_8192",
        "Llama 3 405B, 8,192 GPUs, TP 8 x PP 16 x DP 64, seq 8192",
        8192,
        tuple(f"{_BASE} --training.seq_len 8192 --training.local_batch_size 32".split()),
        430,
    ),
    HeldOut(
        "llama3.405b_8k_16384",
        "Llama 3 405B, 16,384 GPUs, TP 8 x PP 16 x DP 128, seq 8192",
        16384,
        tuple(f"{_BASE} --training.seq_len 8192 --training.local_batch_size 16".split()),
        400,
    ),
    HeldOut(
        "llama3.405b_128k_16384",
        "Llama 3 405B, 16,384 GPUs, TP 8 x CP 16 x PP 16 x DP 8, seq 131072",
        16384,
        tuple(
            f"{_BASE} --training.seq_len 131072 --training.local_batch_size 16 "
            "--parallelism.context_parallel_degree 16 --parallelism.context_parallel_impl allgather".split()
        ),
        380,
    ),
)


@dataclass(frozen=True)
class HeldOutPrediction:
    """A held-out row as the shipped constants (fitted to every published row, none of these) predict it."""

    row: HeldOut
    estimate: Estimate
    profile: HardwareProfile

    @property
    def tflops_per_gpu(self) -> float:
        return self.estimate.mfu_pct / 100 * self.profile.spec.peak_bf16_flops / 1e12

    @property
    def error(self) -> float:
        return self.tflops_per_gpu / self.row.tflops_per_gpu - 1


def predict_held_out(profile: HardwareProfile | None = None) -> list[HeldOutPrediction]:
    """Every held-out row predicted on ``profile`` (default: each row's shipped preset)."""
    out = []
    for row in ROWS:
        hw = profile or load_hardware(row.hardware)
        layout = layout_from_config(load_config(None, list(row.overrides)), row.world_size, impl="torchtitan")
        layout = replace(layout, cp_gathers_gqa_kv=True)
        out.append(HeldOutPrediction(row, estimate(layout, hw), hw))
    return out


def format_held_out(preds: list[HeldOutPrediction]) -> str:
    """The held-out rows as Markdown: published and predicted TFLOPs/GPU, error, memory and its verdict."""
    lines = [
        f"Held out (never fitted; {SOURCE}; reading: {READING}):\n",
        "| row | GPUs | layout | TFLOPs/GPU published | predicted | error | memory GiB | fits 80 GB |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    errors = []
    for p in preds:
        e = p.estimate
        errors.append(abs(p.error))
        lines.append(
            f"| {p.row.name} | {p.row.world_size:,} | {e.layout.describe()} | {p.row.tflops_per_gpu:.0f} | "
            f"{p.tflops_per_gpu:.0f} | {p.error:+.1%} | {e.peak_memory_gib:.1f} | {'yes' if e.fits else 'NO'} |"
        )
    lines.append(f"\nheld-out max |error| {max(errors):.1%} (bar {TOLERANCE:.0%}), median {sorted(errors)[1]:.1%}")
    return "\n".join(lines)
