"""FSDP2: ``fully_shard`` per transformer block and on the root, with mixed precision; HSDP on a 2-D mesh."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from meshforge.device.dtypes import DTYPES
from meshforge.model.moe import moe_layers
from meshforge.parallel.cpu_offload import offload_policy


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: bool,
    expert_mesh: DeviceMesh | None = None,
    cpu_offload: bool = False,
    accumulate_dtype: str = "float32",
) -> None:
    """Shard every transformer block, then the root (embedding, norm, output). ``mesh`` is 1-D (FSDP) or 2-D
    (replicate, shard) for HSDP. Under expert parallel (``expert_mesh`` = (efsdp, ep)) each MoE layer's routed
    experts, ep-sharded on dim 0, are sharded on dim 1 over efsdp first (FSDP averages their gradients over efsdp;
    the experts scale them by 1 / ep themselves, parallel/expert_parallel.py). ``cpu_offload``: FSDP2's
    CPUOffloadPolicy on every call (parallel/cpu_offload.py). ``accumulate_dtype``: what the backwards that skip the
    exchange sum their unsharded gradients in (``accumulate_in``)."""
    mp_policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    offload = offload_policy(cpu_offload, mesh.device_type)
    layers = list(model.layers.values())  # type: ignore[operator, union-attr]
    for i, block in enumerate(layers):
        # the last block's weights are needed again at once by backward: keep them gathered
        reshard = reshard_after_forward and i < len(layers) - 1
        for moe in moe_layers(block) if expert_mesh is not None else []:
            assert expert_mesh is not None
            fully_shard(
                moe.experts,
                mesh=expert_mesh["efsdp"],
                mp_policy=mp_policy,
                reshard_after_forward=reshard,
                shard_placement_fn=lambda _: Shard(1),
                offload_policy=offload,
            )
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(
        model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward, offload_policy=offload
    )
    accumulate_in(model, DTYPES[accumulate_dtype])


def accumulate_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Sum the unsharded gradients of the backwards that skip the exchange (gradient_sync once per step, a pipeline's
    microbatches) in ``dtype``, and exchange them in the policy's reduce dtype. FSDP2 up-casts them to its reduce dtype
    as they arrive, but clamps that to None when it equals the parameter dtype (FSDPParam.init_dtype_attrs): with
    bf16 parameters and a bf16 reduce the micro-steps were summed in bf16. Its lazy initialization (the root's first
    forward) sets those dtypes, so a forward pre-hook that runs after FSDP's sets, on every FSDP module of ``model``,
    each parameter's up-cast dtype (none where the gradient already has ``dtype`` or is fp32: FSDP would otherwise
    sum fp32 parameters' gradients in a bf16 reduce dtype) and the group's reduce dtype
    (the policy's, which FSDP's clamp would otherwise let the accumulated dtype decide). Idempotent, every forward."""

    def hook(*_: Any) -> None:
        for module in model.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            if group is None:
                continue
            for param in group.fsdp_params:
                compute = param.param_dtype or param.orig_dtype  # fp32 gradients are summed in fp32
                param.reduce_dtype = None if compute in (dtype, torch.float32) else dtype
            group._reduce_dtype = group.mp_policy.reduce_dtype or group.mp_policy.param_dtype or group._orig_dtype

    model.register_forward_pre_hook(hook)
