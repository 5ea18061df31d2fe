"""Where a collective's tensors must live: on a device the group's backend can move (NCCL has no CPU tensors).

Every tensor meshforge hands to a collective is made by :func:`collective_tensor` or moved by
:func:`to_collective_device`, so a figure computed on the host (peak memory, idle shares) cannot reach an NCCL group
as a CPU tensor. The rule comes from torch's own table, ``dist.Backend.backend_capability`` (gloo: cpu and cuda;
nccl: cuda; xccl: xpu; ...). Host figures prefer the host when the backend takes it (no device round trip).

Where meshforge's collectives are (audited): metrics (peak memory, max), the loss mean (train/loop.py
``global_mean``), the pipeline grad norm (train/optim.py), the bubble shares (parallel/pipeline/bubble.py) use these
helpers; the checkpointer's object collectives run on its own gloo group (host objects, which gloo takes); the hang
guard talks through the rendezvous store only; data loading has no collectives; DTensor / FSDP / DCP place their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def backend_devices(backend: str) -> list[str]:
    """Device types a backend (``"nccl"``, ``"gloo"``, or a mixed ``"cpu:gloo,cuda:nccl"``) can run collectives on."""
    backend = str(backend).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        return [part.split(":", 1)[0] for part in backend.split(",")]
    capability = dist.Backend.backend_capability.get(backend)
    if capability is None:
        raise RuntimeError(f"unknown process-group backend {backend!r}: cannot tell which devices its collectives take")
    return list(capability)


def device_for_type(device_type: str) -> torch.device:
    """The current device of ``device_type`` (without an index when that accelerator is not initialised here)."""
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type, None)
    if module is not None and module.is_available():
        return torch.device(device_type, module.current_device())
    return torch.device(device_type)


def collective_device(group: dist.ProcessGroup | None = None, prefer: str = "cpu") -> torch.device:
    """The device for tensors of a collective on ``group`` (None: the default group): ``prefer`` when the backend
    takes it, else the backend's first device type (nccl -> the current CUDA device)."""
    devices = backend_devices(dist.get_backend(group))
    return device_for_type(prefer if prefer in devices else devices[0])


def collective_tensor(
    values: Sequence[float] | float, group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """A 1-D tensor of host ``values`` on the device a collective on ``group`` needs."""
    data = [values] if isinstance(values, int | float) else list(values)
    return torch.tensor(data, dtype=dtype, device=collective_device(group))


def to_collective_device(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``tensor`` itself when the group's backend takes its device, else a copy on the backend's device."""
    if tensor.device.type in backend_devices(dist.get_backend(group)):
        return tensor
    return tensor.to(collective_device(group))
