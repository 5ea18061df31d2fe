"""Metrics people trust: loss, grad norm, lr, tokens/s per device, TFLOPs, MFU, peak memory, data-loading share.

Definitions (TorchTitan's, so figures compare): tokens/s per device = tokens this data-parallel rank trained on in the
interval / (seconds x cp x tp x pp); TFLOPs = flops_per_token x tokens/s per device; MFU = that / the peak FLOP/s of one
device (device/peak.py: a table of exact GPU models; on a CPU the cached matmul probe in the run's dtype, raised to
the highest FLOP/s a logged interval reached when that is higher, and said so). No MFU with Float8 or an unknown GPU.

MFU comes in two conventions, both per record: ``mfu_pct``, MFU (TorchTitan convention, attention counted in full:
12 x L x H x Q x T), and ``mfu_causal_pct``, MFU (causal, attention halved, Megatron-Bridge convention): the same
tokens/s over ``flops_per_token_causal`` (model/flavors.causal_flops_per_token), the same peak.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshforge.device.collectives import collective_tensor
from meshforge.device.transfer import synchronize
from meshforge.errors import ConfigError


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: max reserved memory; CPU: the process's peak resident set since the last reset (VmHWM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


@dataclass
class Interval:
    """What happened since the last logged step."""

    start: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    data_seconds: float = 0.0


class MetricsLogger:
    """Aggregates per-step figures and writes them every ``log_freq`` steps (console on logging ranks, JSONL and
    TensorBoard on rank 0). ``log`` is collective: every rank must call it at the same steps."""

    def __init__(
        self,
        *,
        dump_folder: str,
        rank: int,
        console: bool,
        flops_per_token: float,
        flops_per_token_causal: float | None = None,
        peak_flops: float | None,
        peak_source: str,
        non_dp_size: int,
        peak_from_probe: bool = False,
        device: torch.device,
        tensorboard: bool,
        progress_bar: bool = False,
        wandb: bool = False,
    ) -> None:
        self.rank, self.console, self.device = rank, console, device
        self.flops_per_token, self.peak_flops, self.peak_source = flops_per_token, peak_flops, peak_source
        self.flops_per_token_causal = flops_per_token if flops_per_token_causal is None else flops_per_token_causal
        self.non_dp_size = non_dp_size
        self.peak_from_probe = peak_from_probe  # a measured (CPU) peak: what the run itself reaches bounds it
        self.interval = Interval()
        self.records: list[dict[str, Any]] = []
        self.path = Path(dump_folder) / "metrics.jsonl"
        self.t0 = time.perf_counter()
        self.tb: Any = None
        self.wandb: Any = None
        self.progress: Any = None
        self.task: Any = None
        if progress_bar and console and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(), TimeRemainingColumn(), transient=True
            )
        if rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.wandb = start_wandb(dump_folder) if wandb else None
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(dump_folder) / "tb"))
        reset_peak_memory(device)

    def start(self, step: int) -> None:
        """Begin logging after ``step`` (0, or the step a checkpoint resumed): metrics.jsonl keeps the records up to
        it and drops later ones (they belong to the run that died); timing starts now, not at set-up."""
        if self.rank == 0:
            kept = []
            if self.path.is_file():
                kept = [
                    line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step
                ]
            self.path.write_text("".join(line + "\n" for line in kept))
        synchronize(self.device)  # set-up work still queued on the device is not the first interval's
        self.interval = Interval()
        reset_peak_memory(self.device)

    def step_done(self, step: int, total: int) -> None:
        """Advance the progress bar (rank 0, interactive terminals only, when metrics.progress_bar)."""
        if self.progress is None:
            return
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task("training", total=total)
        self.progress.update(self.task, completed=step)
        if step >= total:
            self.progress.stop()

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of work (an evaluation) out of the current interval's step time and throughput."""
        self.interval.start += seconds

    def add_tokens(self, tokens: int, data_seconds: float) -> None:
        self.interval.tokens += tokens
        self.interval.data_seconds += data_seconds

    def log(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, extra: dict[str, float] | None = None
    ) -> dict[str, Any]:
        """Reduce over ranks (mean loss over data-parallel ranks is done by the caller; here: max memory), write."""
        synchronize(self.device)  # the interval's queued device work belongs to it: once per interval
        elapsed = time.perf_counter() - self.interval.start
        memory = peak_memory_gib(self.device)
        if dist.is_initialized():
            mem = collective_tensor([memory])
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            memory = float(mem.item())
        tps = self.interval.tokens / (elapsed * self.non_dp_size)
        self._bound_peak(self.flops_per_token * tps)
        peak = self.peak_flops or 1.0
        record: dict[str, Any] = {
            "step": step,
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tps": tps,
            "tflops": self.flops_per_token * tps / 1e12,
            "mfu_pct": None if self.peak_flops is None else 100 * self.flops_per_token * tps / self.peak_flops,
            "mfu_causal_pct": None if self.peak_flops is None else 100 * self.flops_per_token_causal * tps / peak,
            "peak_memory_gib": memory,
            "data_loading_pct": 100 * self.interval.data_seconds / elapsed,
            "step_time_s": elapsed,
            "elapsed_s": time.perf_counter() - self.t0,
            **(extra or {}),
        }
        self.records.append(record)
        if self.rank == 0:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if self.wandb is not None:
                self.wandb.log({k: v for k, v in record.items() if v is not None}, step=step)
            if self.tb is not None:
                for key, value in record.items():
                    if isinstance(value, int | float) and key != "step":
                        self.tb.add_scalar(key, value, step)
        if self.console:
            print_record(record)
        self.interval = Interval()
        reset_peak_memory(self.device)
        return record

    def _bound_peak(self, achieved: float) -> None:
        """A probed peak below what this run's own matmuls reached is no peak: take the observed FLOP/s instead
        (so MFU never exceeds 100 %) and say so once per raise."""
        if not self.peak_from_probe or self.peak_flops is None or achieved <= self.peak_flops:
            return
        probe = self.peak_flops
        self.peak_flops = achieved
        self.peak_source = f"observed {achieved:.3g} FLOP/s, above the probe's {probe:.3g} ({self.peak_source})"
        if self.console:
            print(
                f"meshforge: this run reached {achieved / 1e9:.3g} GFLOP/s per device, above the CPU probe's "
                f"{probe / 1e9:.3g}; MFU uses the observed figure as the peak from here on",
                file=sys.stdout,
                flush=True,
            )

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.progress is not None and self.task is not None:
            self.progress.stop()
        if self.tb is not None:
            self.tb.close()


def print_record(r: dict[str, Any]) -> None:
    mfu = "n/a" if r["mfu_pct"] is None else f"{r['mfu_pct']:.2f}%"
    if r.get("mfu_causal_pct") is not None:
        mfu += f" (causal {r['mfu_causal_pct']:.2f}%)"
    line = (
        f"step {r['step']:>5}  loss {r['loss']:8.4f}  grad_norm {r['grad_norm']:7.3f}  lr {r['lr']:.2e}  "
        f"tps {r['tps']:9.1f}  tflops {r['tflops']:7.3f}  mfu {mfu}  mem {r['peak_memory_gib']:.2f}GiB  "
        f"data {r['data_loading_pct']:.1f}%"
    )
    if "bubble_pct" in r:
        line += f"  bubble {r['bubble_pct']:.1f}%"
    if "val_loss" in r:
        line += f"  val_loss {r['val_loss']:.4f}  val_ppl {r['val_ppl']:.2f}"
    if "moe_max_load" in r:
        line += f"  moe max/mean load {r['moe_max_load']:.2f}"
    print(line, file=sys.stdout, flush=True)


def log_step(step: int, log_freq: int, total: int) -> bool:
    """Whether optimizer step ``step`` logs (and so may read the device): the first, every ``log_freq``-th, the last."""
    return step == 1 or step % log_freq == 0 or step == total


def logging_ranks(spec: str, world_size: int) -> set[int]:
    """Parse job.log_rank: '0', '0,3', '0-3' or 'all'."""
    if spec == "all":
        return set(range(world_size))
    ranks: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if not lo.strip().isdigit() or (hi and not hi.strip().isdigit()):
            raise ConfigError(f"job.log_rank = {spec!r} must look like 0, 0,3, 0-3 or all")
        ranks.update(range(int(lo), int(hi or lo) + 1))
    return ranks


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def start_wandb(dump_folder: str) -> Any:
    """A Weights & Biases run (rank 0); project from $WANDB_PROJECT (default "meshforge"), offline with WANDB_MODE."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "metrics.enable_wandb = true needs the wandb package: pip install wandb (and wandb login)"
        ) from None
    project = os.environ.get("WANDB_PROJECT", "meshforge")
    return wandb.init(project=project, dir=dump_folder, name=os.environ.get("WANDB_RUN_NAME"))
