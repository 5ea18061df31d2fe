"""FSDP CPU offload (``training.enable_cpu_offload``, TorchTitan's spelling): FSDP2's ``CPUOffloadPolicy`` on every
``fully_shard`` call. The sharded parameters, their gradients and the optimizer states live in host memory (pinned
on CUDA); FSDP copies each shard to the device before its all-gather and each reduce-scattered gradient back to the
host, and the optimizer step runs on the host.

What this needs from the rest of the job: the parameters materialised on the host (FSDP refuses device shards) with
the buffers (RoPE cache, MoE counters) on the device (``materialize``), and a CPU backend beside NCCL for the
collectives on host tensors (the gradient-norm reduction of clipping): ``cuda:nccl,cpu:gloo`` (parallel/
distributed.py's ``process_group_backend``). Gradient accumulation works as is (FSDP then copies each gradient
synchronously and accumulates on the host). On a CPU-only machine the same policy is applied through the same API,
but the tensors were on the host already: no memory moves (the banner says so); FSDP's offload branch still runs
(no foreach copy into the all-gather under a param dtype, the host-side gradient add), which
tests/distributed/test_cpu_offload.py checks bit for bit against the run without it. The pinned, non-blocking CUDA
path runs on fake CUDA tensors in scripts/fake_cuda_check.py."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from meshforge.parallel.layout import check_cpu_offload as check_cpu_offload  # the rule lives with the layout's


def offload_policy(enabled: bool, device_type: str) -> OffloadPolicy:
    """The policy for ``fully_shard``: CPU offload (pinned host memory on CUDA only) or none."""
    return CPUOffloadPolicy(pin_memory=device_type == "cuda") if enabled else OffloadPolicy()


def materialize(model: nn.Module, device: torch.device, *, cpu_offload: bool) -> None:
    """``to_empty`` for a parallelized meta-device model: on ``device``, or under CPU offload the parameters on the
    host and the buffers on ``device`` (they are not FSDP's and the forward reads them there)."""
    if not cpu_offload or device.type == "cpu":
        model.to_empty(device=device)
        return
    model.to_empty(device="cpu")
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer, device=device)


def banner(enabled: bool, device: torch.device) -> str:
    """The start-up banner's sentence (empty when off)."""
    if not enabled:
        return ""
    if device.type == "cpu":
        return (
            "FSDP CPU offload: CPUOffloadPolicy applied on every fully_shard, a no-op for memory on a CPU-only "
            "machine (the shards were on the host already)"
        )
    return "FSDP CPU offload: sharded parameters, gradients and the optimizer step on the host (pinned memory)"
