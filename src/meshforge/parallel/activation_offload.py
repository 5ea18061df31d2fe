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
tensor leaves the device at pack and is allocated again at unpack. A DTensor (TP / SP activations) moves its local shard
and is rebuilt at unpack; other tensor subclasses (Float8 tensors) stay on the device."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, DTensorSpec | None]:
    """The plain tensor to copy and, for a DTensor (TP / SP activations), the spec that rebuilds it at unpack."""
    if isinstance(tensor, DTensor):
        return tensor._local_tensor, tensor._spec
    return tensor, None


def _rebuild(local: torch.Tensor, spec: DTensorSpec | None) -> torch.Tensor:
    return local if spec is None else DTensor(local, spec, requires_grad=False)


def _offloadable(tensor: torch.Tensor) -> bool:
    """Plain tensors and DTensors over plain tensors; other wrapper subclasses (Float8 tensors) stay put."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return not is_traceable_wrapper_subclass(local)


class HostCopyOffload(saved_tensors_hooks):
    """Saved tensors copied into separate host buffers (the CPU path; also what a non-CUDA device falls back to)."""

    def __init__(self) -> None:
        super().__init__(self.pack, self.unpack)

    @staticmethod
    def pack(tensor: torch.Tensor) -> Any:
        if not _offloadable(tensor):
            return tensor
        local, spec = _local(tensor)
        host = torch.empty_like(local, device="cpu")  # its strides kept (a dense view): backward's kernels unchanged
        host.copy_(local)
        return local.device, host, spec

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, spec = packed
        return _rebuild(host if device.type == "cpu" else host.to(device), spec)


class StreamOffload(saved_tensors_hooks):
    """CUDA: device-to-host copies into pinned buffers on a side stream with events, host-to-device copies at unpack
    on the compute stream after a device-side wait (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(self.pack, self.unpack)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "cuda" or not _offloadable(tensor):  # host tensors and other subclasses stay
            return tensor
        tensor, spec = _local(tensor)
        compute = torch.cuda.current_stream(tensor.device)
        self.stream.wait_stream(compute)
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, device="cpu", pin_memory=True)
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        tensor.record_stream(self.stream)
        return tensor.device, host, done, spec

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, done, spec = packed
        compute = torch.cuda.current_stream(device)
        compute.wait_event(done)  # on the device: the copy back starts after the copy out ended
        return _rebuild(host.to(device, non_blocking=True), spec)


def offload_context(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Around forward (and the backward it feeds): saved tensors to host memory when ``enabled``."""
    if not enabled:
        return contextlib.nullcontext()
    if device.type == "cuda":
        return StreamOffload(device)
    return HostCopyOffload()
