"""Host batches onto the device, and the one place the host waits for the device before reading a clock.

On CUDA a batch is copied from pinned (page-locked) host memory with ``non_blocking=True``: the copy is queued
behind the previous step's kernels instead of making the host wait for them, so the time the loop counts as data
loading is the loader's own. Reading a clock then needs the device to have finished the queued work:
:func:`synchronize` runs once per log interval (metrics), never per step. On a CPU both are no-ops.
"""

from __future__ import annotations

import torch


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``batch`` (a host tensor) on ``device``: itself on a CPU; pinned and copied asynchronously on an
    accelerator (the caching host allocator keeps the pinned buffer alive until the copy has run)."""
    if device.type == "cpu":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued on it (CUDA); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
