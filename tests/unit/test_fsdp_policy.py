"""FSDP's policies as applied to every wrapped module of the real parallelization (fake process group, meta device):
gradients reduce in fp32 when the parameters compute in bf16, and weights stay gathered after forward under PP."""

from __future__ import annotations

import torch
from fakeworld import parallelized
from torch.distributed.fsdp import FSDPModule

from meshforge.parallel.layout import resolve_reshard_after_forward


def fsdp_modules(parts: dict[int, list[torch.nn.Module]]) -> dict[str, FSDPModule]:
    out = {}
    for p, stages in parts.items():
        for s, stage in enumerate(stages):
            out |= {f"pp{p}.{s}.{n or 'root'}": m for n, m in stage.named_modules() if isinstance(m, FSDPModule)}
    return out


def test_every_wrapped_module_reduces_in_fp32_when_params_are_bf16() -> None:
    with parallelized(["--training.mixed_precision_param", "bfloat16"], world=2) as parts:
        modules = fsdp_modules(parts)
        policies = {name: m._get_fsdp_state()._mp_policy for name, m in modules.items()}
    assert len(policies) == 8 + 1  # the tiny flavor's 8 blocks and the root
    wrong = {n: (p.param_dtype, p.reduce_dtype) for n, p in policies.items() if p.reduce_dtype != torch.float32}
    assert not wrong, f"FSDP reduces gradients in the parameter dtype, not training.mixed_precision_reduce: {wrong}"
    assert all(p.param_dtype == torch.bfloat16 for p in policies.values())


def test_default_reshard_policy_keeps_weights_gathered_under_pp() -> None:
    assert resolve_reshard_after_forward("default", pipeline_parallel=False)
    assert not resolve_reshard_after_forward("default", pipeline_parallel=True), "FSDP reshards under PP by default"
    assert resolve_reshard_after_forward("always", True) and not resolve_reshard_after_forward("never", False)
    overrides = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule"]
    overrides += ["ZBVZeroBubble", "--activation_checkpoint.mode", "none"]
    with parallelized(overrides, world=4) as parts:
        groups = {n: m._get_fsdp_state()._fsdp_param_group for n, m in fsdp_modules(parts).items()}
    resharding = [n for n, g in groups.items() if g is not None and g.post_forward_mesh_info is not None]
    assert groups and not resharding, f"FSDP reshards after forward under a zero-bubble pipeline: {resharding}"
