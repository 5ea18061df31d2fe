"""``gradient_sync.regather = auto``, decided by memory after the run's first step and re-decided while kept.

Under one gradient exchange per step (parallel/gradient_sync.py), ``keep`` leaves every FSDP module's parameters
gathered between micro-steps: the next micro-step's forward all-gathers nothing, at the cost of this rank's unsharded
parameters held until the step's last backward. ``auto`` measures instead of guessing: the first step runs with
``reshard`` (FSDP's memory), then every rank budgets with device/memory_budget.py ``fits`` (the planner's rule too,
plan/physics/peak.py ``resolve_gradient_sync``): the allocator's reserved peak (fragmentation included), plus the
bytes keeping would add at the measured fragmentation (reserved / allocated peak), plus the memory outside the
allocator (the CUDA context, NCCL's buffers: what the device reports in use beyond the allocator's reservation, at
least the stated ``RUNTIME_GIB``, since a communicator may first be made after the reading) within the device's
capacity. The ranks take ``keep`` from the next step only if it fits on all of them (one MIN all-reduce).

Re-decided: the peak can move later (MoE routing imbalance grows, longer documents), so while parameters are kept the
ranks decide again on every log step (the host waits for the device there anyway; one int all-reduce) from the peak
since the last log step, which then holds the kept parameters already: ``reshard`` from the next step when it no
longer fits on every rank. One way only: a peak measured resharded would say keep again, and a verdict that flips with
the routing would flip the memory with it. On a CPU there is no device memory to budget (the host's is shared with
everything else): ``reshard``, unless readings are given (``device_readings``; tests force ``keep`` that way).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshforge.config.schema import JobConfig
from meshforge.device.memory_budget import GIB, RUNTIME_GIB, fits
from meshforge.device.precision import resolve_param_dtype
from meshforge.parallel.gradient_sync import once_per_step

NOT_FSDP = ("tp", "ep")
"""Mesh dimensions that shard a parameter for tensor / expert parallel: gathering for FSDP leaves those sharded."""


def unsharded_numel(param: torch.Tensor) -> int:
    """Elements of ``param`` on this rank once FSDP has all-gathered it (tensor / expert parallel shards stay). Any
    placement that is neither replicated nor partial shards: FSDP x TP shards dim 0 with ``_StridedShard``, which is
    no ``Shard`` (``is_shard()`` is False for it in torch 2.13)."""
    if not isinstance(param, DTensor):
        return param.numel()
    names = param.device_mesh.mesh_dim_names or ()
    factor = 1
    for dim, placement in enumerate(param.placements):
        shards = not (placement.is_replicate() or placement.is_partial())
        if shards and (dim >= len(names) or names[dim] not in NOT_FSDP):
            factor *= param.device_mesh.size(dim)
    return param.to_local().numel() * factor


def gathered_bytes(model_parts: Iterable[nn.Module], dtype: torch.dtype) -> int:
    """Bytes this rank's parameters take all-gathered in ``dtype`` (FSDP's compute dtype): what ``keep`` holds."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(unsharded_numel(p) * item for part in model_parts for p in part.parameters())


@dataclass(frozen=True)
class Readings:
    """One rank's device memory (bytes): the allocator's reserved and allocated peaks since the last reset (the
    metrics logger resets them on each log step), what the device has in use outside the allocator now, its size."""

    reserved_peak: int
    allocated_peak: int
    outside: int
    capacity: int

    @property
    def slack(self) -> float:
        """Fragmentation: reserved / allocated - 1 at the peak."""
        return self.reserved_peak / self.allocated_peak - 1 if self.allocated_peak else 0.0


def device_readings(device: torch.device) -> Readings | None:
    """The readings of a CUDA device; None elsewhere (nothing to budget)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)  # context, NCCL, other processes on the device
    peaks = torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device)
    return Readings(*peaks, outside=max(0, outside), capacity=total)


def keep_fits(readings: Readings, added: int) -> bool:
    """device/memory_budget.py ``fits`` with this rank's readings: ``added`` bytes more at the measured slack, and
    the memory outside the allocator, at least the stated reserve."""
    outside = max(readings.outside, RUNTIME_GIB * GIB)
    return fits(readings.reserved_peak, added, readings.slack, outside, readings.capacity)


def agree(keep: bool, device: torch.device) -> bool:
    """Keep only if every rank can: one MIN all-reduce over the default group (no-op in a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return keep
    flag = torch.tensor(int(keep), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def decide_keep(
    model_parts: list[nn.Module], device: torch.device, param_dtype: str, *, kept: bool = False
) -> tuple[bool, str]:
    """Keep (True) when it fits every rank's device, and a line saying why (rank 0 prints it). ``param_dtype``:
    training.mixed_precision_param; ``kept``: the parameters are kept already (the peak holds them: nothing added).
    A collective over the default group when the readings exist: every rank calls it at the same step."""
    readings = device_readings(device)
    if readings is None:
        return False, "gradient_sync.regather auto: reshard (no device memory to budget on a CPU)"
    dtype = getattr(torch, resolve_param_dtype(param_dtype, device)[0])
    gathered = 0 if kept else gathered_bytes(model_parts, dtype)
    keep = agree(keep_fits(readings, gathered), device)
    outside = max(readings.outside, RUNTIME_GIB * GIB)
    sums = f"reserved peak {readings.reserved_peak / GIB:.1f} GiB + gathered {gathered / GIB:.1f} GiB"
    sums += f" x {1 + readings.slack:.2f} (fragmentation) + {outside / GIB:.1f} GiB outside the allocator"
    sums += f" vs {readings.capacity / GIB:.1f} GiB"
    verdict = "keep from the next step" if keep else "reshard (keeping would not fit on every rank)"
    verdict = ("still keep" if keep else "reshard from the next step (the peak moved)") if kept else verdict
    return keep, f"gradient_sync.regather auto: {verdict}; this rank: {sums}"


def auto_keep(
    cfg: JobConfig, model_parts: list[nn.Module], device: torch.device, *, fsdp_without_pp: bool, kept: bool = False
) -> bool:
    """Called by every rank after the run's first step, and while ``kept`` on every log step (module docstring):
    whether the next steps keep parameters gathered between micro-steps. Only ``regather = auto`` under one
    exchange per step with FSDP and no pipeline is decided here (``keep`` / ``reshard`` are the user's; a
    pipeline's stages stay gathered inside its schedule already). Rank 0 prints the first verdict and a change."""
    sync = cfg.gradient_sync
    if sync.regather != "auto" or not fsdp_without_pp:
        return False
    if not once_per_step(sync, cfg.training.gradient_accumulation_steps):
        return False
    keep, why = decide_keep(model_parts, device, cfg.training.mixed_precision_param, kept=kept)
    if (not kept or not keep) and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"meshforge: {why}", flush=True)
    return keep
