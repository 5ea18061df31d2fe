"""``gradient_sync.regather = auto``, decided by memory once, after the run's first step.

Under one gradient exchange per step (parallel/gradient_sync.py), ``keep`` leaves every FSDP module's parameters
gathered between micro-steps: the next micro-step's forward all-gathers nothing, at the cost of this rank's unsharded
parameters held until the step's last backward. ``auto`` measures instead of guessing: the first step runs with
``reshard`` (FSDP's memory), then every rank compares its measured peak plus the bytes keeping would add with the
device's capacity, and the ranks take ``keep`` from the next step only if it fits on all of them (one MIN all-reduce,
once per run). On a CPU there is no device memory to budget (the host's is shared with everything else): ``reshard``.
The planner prices the same rule (plan/physics/peak.py ``resolve_gradient_sync``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshforge.config.schema import JobConfig
from meshforge.device.precision import resolve_param_dtype
from meshforge.parallel.gradient_sync import once_per_step

HEADROOM = 0.9
"""The share of the device's memory a kept-gathered step may reach (the rest: the allocator's fragmentation, NCCL)."""
NOT_FSDP = ("tp", "ep")
"""Mesh dimensions that shard a parameter for tensor / expert parallel: gathering for FSDP leaves those sharded."""


def unsharded_numel(param: torch.Tensor) -> int:
    """Elements of ``param`` on this rank once FSDP has all-gathered it (tensor / expert parallel shards stay)."""
    if not isinstance(param, DTensor):
        return param.numel()
    names = param.device_mesh.mesh_dim_names or ()
    factor = 1
    for dim, placement in enumerate(param.placements):
        if placement.is_shard() and (dim >= len(names) or names[dim] not in NOT_FSDP):
            factor *= param.device_mesh.size(dim)
    return param.to_local().numel() * factor


def gathered_bytes(model_parts: Iterable[nn.Module], dtype: torch.dtype) -> int:
    """Bytes this rank's parameters take all-gathered in ``dtype`` (FSDP's compute dtype): what ``keep`` holds."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(unsharded_numel(p) * item for part in model_parts for p in part.parameters())


def fits(peak: int, gathered: int, capacity: int) -> bool:
    """Whether a step measured at ``peak`` bytes plus ``gathered`` bytes held stays within HEADROOM of ``capacity``."""
    return peak + gathered <= HEADROOM * capacity


def agree(keep: bool, device: torch.device) -> bool:
    """Keep only if every rank can: one MIN all-reduce over the default group (no-op in a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return keep
    flag = torch.tensor(int(keep), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def decide_keep(model_parts: list[nn.Module], device: torch.device, param_dtype: str) -> tuple[bool, str]:
    """After the first step: keep (True) when it fits every rank's device, and a line saying why (rank 0 prints it).
    ``param_dtype``: training.mixed_precision_param. A collective over the default group when distributed on CUDA:
    every rank calls it at the same step."""
    if device.type != "cuda":
        return False, "gradient_sync.regather auto: reshard (no device memory to budget on a CPU)"
    peak = torch.cuda.max_memory_allocated(device)
    capacity = torch.cuda.mem_get_info(device)[1]
    gathered = gathered_bytes(model_parts, getattr(torch, resolve_param_dtype(param_dtype, device)[0]))
    keep = agree(fits(peak, gathered, capacity), device)
    gib = 2**30
    sums = f"peak {peak / gib:.1f} GiB + gathered {gathered / gib:.1f} GiB"
    sums += f" vs {HEADROOM:.0%} of {capacity / gib:.1f} GiB"
    verdict = "keep from the next step" if keep else "reshard (keeping would not fit on every rank)"
    return keep, f"gradient_sync.regather auto: {verdict}; this rank: {sums}"


def auto_keep(cfg: JobConfig, model_parts: list[nn.Module], device: torch.device, *, fsdp_without_pp: bool) -> bool:
    """Called by every rank after the run's first step: whether the later steps keep parameters gathered between
    micro-steps. Only ``regather = auto`` under one exchange per step with FSDP and no pipeline is decided here
    (``keep`` / ``reshard`` are the user's; a pipeline's stages stay gathered inside its schedule already)."""
    sync = cfg.gradient_sync
    if sync.regather != "auto" or not fsdp_without_pp:
        return False
    if not once_per_step(sync, cfg.training.gradient_accumulation_steps):
        return False
    keep, why = decide_keep(model_parts, device, cfg.training.mixed_precision_param)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"meshforge: {why}", flush=True)
    return keep
