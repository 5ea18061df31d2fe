"""Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437 sec. 2.1.2) and the expert-load metric.

Once per optimizer step, before it: every MoE layer's routed-token counts of the step (all micro-steps) are summed
over the data-parallel x context-parallel ranks, so every rank sees the global load and applies the same update
``bias += coeff x sign(mean - count)`` (then centred, as TorchTitan does); the counters restart. Tensor-parallel ranks
route the same tokens and pipeline stages own different layers, so neither takes part in the sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshforge.device.collectives import to_collective_device
from meshforge.model.moe import moe_layers


@torch.no_grad()
def balance_experts(
    model_parts: list[nn.Module],
    dp_cp_mesh: DeviceMesh | None,
    pp_mesh: DeviceMesh | None,
    coeff: float,
    across: Callable[[torch.Tensor], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Update the expert biases from this step's loads (coeff 0: only measure); returns the max/mean expert load of
    the most imbalanced MoE layer (``moe_max_load``: 1.0 = perfectly balanced; over all pipeline stages), a device
    scalar the loop reads on log steps only. ``across``
    sums the counts over torchft's replica groups too (train/fault_tolerance.py), so every group sees HSDP's load."""
    layers = [m for part in model_parts for m in moe_layers(part)]
    if not layers and pp_mesh is None:
        return {}
    if not layers:  # a pipeline stage without MoE layers still joins the stages' max
        return {"moe_max_load": _stage_max(torch.zeros(()), pp_mesh)}
    counts = torch.stack([m.tokens_per_expert for m in layers])  # (moe layers, experts)
    if dp_cp_mesh is not None:
        dist.all_reduce(counts, group=dp_cp_mesh.get_group())
    if across is not None:
        across(counts)
    mean = counts.mean(dim=1, keepdim=True)
    if coeff > 0:
        delta = coeff * torch.sign(mean - counts)
        delta -= delta.mean(dim=1, keepdim=True)
        for layer, d in zip(layers, delta, strict=True):
            if layer.expert_bias is not None:
                layer.expert_bias += d
    for layer in layers:
        layer.tokens_per_expert.zero_()
    load = counts.max(dim=1).values / mean.squeeze(1).clamp_min(1e-9)
    return {"moe_max_load": _stage_max(load.max(), pp_mesh)}


def _stage_max(value: torch.Tensor, pp_mesh: DeviceMesh | None) -> torch.Tensor:
    """The max over the pipeline stages, on the device the pipeline group's backend takes (a stage without MoE
    layers holds a host zero, which NCCL refuses)."""
    if pp_mesh is not None:
        group = pp_mesh.get_group()
        value = to_collective_device(value, group).clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value
