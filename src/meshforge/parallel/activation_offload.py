"""Activation offload: the tensors autograd saves for backward go to host memory at pack and come back when backward
unpacks them (our own ``torch.autograd.graph.saved_tensors_hooks``; torch's ``save_on_cpu`` copies on the compute
stream, a blocking ``copy_`` per saved tensor).

On CUDA (``StreamOffload``): pack copies the tensor into a pinned host buffer on a side stream, non-blocking. The side
stream first waits for the compute stream (the copy must see the tensor's producer), the tensor is marked as used by
the side stream (``record_stream``: the caching allocator does not hand its memory to a later kernel before the copy
is done), and an event marks the copy's end. Unpack makes the compute stream wait for that event (a device-side
wait: no host synchronisation) and copies back, non-blocking, on the compute stream; the pinned buffer's reuse is
ordered by torch's caching host allocator, which records the copies' streams. So the compute stream waits only at
unpack (or when the allocator reuses a buffer), never at pack.

On a CPU (``HostCopyOffload``): pack copies into a buffer of its own (``tensor.cpu()`` would return the tensor itself
and the hooks would prove nothing) and unpack returns that copy, so a wrong unpack changes the gradients
(tests/unit/test_activation_offload.py).

Composition: with activation checkpointing the offload applies to what the mode saves (the block inputs under full
AC, everything without AC). Under per-op selective AC the checkpoint's own hooks, pushed inside ours, take
precedence for everything saved in a checkpointed block: its cached op outputs stay on the device (the planner and
the memory run count them there). The memory run (tools/memory_run.py) models these hooks on fake tensors: a saved
tensor leaves the device at pack and is allocated again at unpack."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks


class HostCopyOffload(saved_tensors_hooks):
    """Saved tensors copied into separate host buffers (the CPU path; also what a non-CUDA device falls back to)."""

    def __init__(self) -> None:
        super().__init__(self.pack, self.unpack)

    @staticmethod
    def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        host.copy_(tensor)
        return tensor.device, host

    @staticmethod
    def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, host = packed
        return host if device.type == "cpu" else host.to(device)


class StreamOffload(saved_tensors_hooks):
    """CUDA: device-to-host copies into pinned buffers on a side stream with events, host-to-device copies at unpack
    on the compute stream after a device-side wait (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(self.pack, self.unpack)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "cuda":  # a host tensor saved for backward stays as it is
            return tensor
        compute = torch.cuda.current_stream(tensor.device)
        self.stream.wait_stream(compute)
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, device="cpu", pin_memory=True)
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        tensor.record_stream(self.stream)
        return tensor.device, host, done

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, done = packed
        compute = torch.cuda.current_stream(device)
        compute.wait_event(done)  # on the device: the copy back starts after the copy out ended
        return host.to(device, non_blocking=True)


def offload_context(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Around forward (and the backward it feeds): saved tensors to host memory when ``enabled``."""
    if not enabled:
        return contextlib.nullcontext()
    if device.type == "cuda":
        return StreamOffload(device)
    return HostCopyOffload()
