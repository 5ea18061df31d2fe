"""Activation offload: the tensors autograd saves for backward go to host memory and come back when backward unpacks
them (``torch.autograd.graph.save_on_cpu``; pinned host buffers on CUDA so the copies can run asynchronously).

On a CPU the same hooks run (a host-to-host copy), so the path is tested here. Composition: with activation
checkpointing the offload applies to what the mode saves (the block inputs under full AC, the kept op outputs under
selective AC, everything without AC). Not done: a dedicated side stream for the device-to-host copies (save_on_cpu
copies on the current stream, non-blocking into pinned memory), so the CUDA overlap is what the stream gives."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def offload_context(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Around forward (and the backward it feeds): saved tensors to host memory when ``enabled``."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
