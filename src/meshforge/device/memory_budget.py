"""The one rule for "does it fit the device": training's ``gradient_sync.regather = auto`` (train/regather.py, from
the device's readings) and the planner (plan/physics/peak.py ``resolve_gradient_sync``, from its predicted peak) both
decide with ``fits`` and the reserve below, so the two never budget differently.

A step fits when the caching allocator's reserved peak (allocated bytes plus fragmentation: the allocator keeps whole
segments), plus the bytes the step would add with the same fragmentation, plus the memory outside the allocator,
stays within the device's capacity. Outside the allocator: the CUDA context and the NCCL communicators' buffers,
which no ``torch.cuda.memory_*`` reading counts.
"""

from __future__ import annotations

GIB = 2**30
CUDA_CONTEXT_GIB = 0.5
"""The CUDA context with the kernels' modules and the cuBLAS / cuDNN handles and workspaces outside the caching
allocator (assumed, not measured here: ~0.3-0.6 GiB on Hopper with CUDA 12+ lazy module loading)."""
NCCL_BUFFERS_GIB = 1.0
"""NCCL's buffers for the communicators of a run's process groups (assumed: per communicator ~ channels x peers x
NCCL_BUFFSIZE 4 MiB per protocol, a few hundred MiB at 8 ranks on NVLink; a run has several: FSDP's, TP's, the default
group's, each created at its first collective, possibly after the reading)."""
RUNTIME_GIB = CUDA_CONTEXT_GIB + NCCL_BUFFERS_GIB
"""The stated reserve outside the allocator: the planner's ``HardwareSpec.runtime_gib`` default (GPU presets), and
the least training's budget assumes whatever it measured outside the allocator."""


def fits(reserved_peak: float, added: float, slack: float, outside: float, capacity: float) -> bool:
    """Whether ``reserved_peak`` (the allocator's reserved peak) plus ``added`` bytes at the allocator's ``slack``
    (reserved / allocated - 1: fragmentation) plus ``outside`` (context, communicators) stay within ``capacity``.
    Any unit, the same for all four sizes."""
    return reserved_peak + added * (1 + max(slack, 0.0)) + outside <= capacity
