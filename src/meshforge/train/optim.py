"""AdamW, warm-up + decay schedule, and gradient clipping that is correct for DTensor and pipeline-split models."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from meshforge.config.schema import LRScheduler, Optimizer
from meshforge.device.collectives import to_collective_device


def build_optimizer(model_parts: list[nn.Module], cfg: Optimizer) -> torch.optim.Optimizer:
    """One optimizer over the parameters of all model parts (pipeline stages on this rank). Where DTensors and plain
    tensors mix (an MoE model under TP without EP: the routed experts stay plain, computed whole on every TP rank),
    each kind is its own parameter group, since a foreach step cannot take both."""
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    kinds = [[p for p in params if isinstance(p, DTensor) is d] for d in (True, False)]
    groups: list[Any] = params if not all(kinds) else [{"params": kind} for kind in kinds]
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    how = implementation(cfg.implementation)
    return cls(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, **how)


def implementation(name: str) -> dict[str, bool]:
    """The optimizer's foreach / fused arguments for ``optimizer.implementation``. auto is fused (CUDA and CPU): it
    skips a non-finite step on the device (``step_unless``) and keeps its step counts on the device, where foreach
    and for-loop read each parameter's host step count and need a host read to skip."""
    if name == "auto":
        name = "fused"
    return {"foreach": name == "foreach", "fused": name == "fused"}


def lr_factor(step: int, *, warmup: int, total: int, decay: str, min_factor: float) -> float:
    """Multiplier of the peak lr for the optimizer step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay == "linear":
        return 1.0 - progress * (1.0 - min_factor)
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int) -> LambdaLR:
    def factor(step: int) -> float:
        return lr_factor(
            step, warmup=cfg.warmup_steps, total=total_steps, decay=cfg.decay_type, min_factor=cfg.min_lr_factor
        )

    return LambdaLR(optimizer, factor)


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """``optimizer.step()`` that updates nothing (parameters, moments, step counts) where the device flag ``skip`` is
    1. Fused: AMP's ``found_inf`` on the device, no host read. foreach / for-loop cannot take it: one host read."""
    if all(group.get("fused") for group in optimizer.param_groups):
        optimizer.found_inf = skip  # type: ignore[attr-defined]  # read by Adam/AdamW.step for the fused kernel
        optimizer.step()
    elif not bool(skip):  # host read: optimizer.implementation = foreach / for-loop
        optimizer.step()


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh | None) -> torch.Tensor:
    """Global L2 norm of all gradients (summed over shards, meshes and pipeline stages, in float64); scales them
    down to ``max_norm`` when larger (max_norm 0: only measure)."""
    params = [p for p in params if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}  # expert parallel: experts live on another mesh than the rest
    for p in params:
        by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    norms = []
    for members in by_mesh.values():
        # float64: a float32 norm of one large gradient (e.g. 2048 x 256) is off by ~1e-4 relative, which would make
        # norms of different layouts disagree by more than their gradients do
        per_tensor = torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in members])  # type: ignore[arg-type]
        norm = torch.linalg.vector_norm(per_tensor)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # partial norms of shards -> full
    total = norms[0] if len(norms) == 1 else torch.stack(norms).pow(2).sum().sqrt()
    if pp_mesh is not None:
        group = pp_mesh.get_group()
        squared = to_collective_device(total.pow(2), group)
        dist.all_reduce(squared, group=group)
        total = squared.sqrt()
    if max_norm > 0:
        for members in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, total, foreach=None)  # foreach on CUDA only
    return total
