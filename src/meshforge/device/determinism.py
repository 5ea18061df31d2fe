"""``training.deterministic``: the switches that make a run repeat bit for bit on its device.

On CUDA, cuBLAS needs a fixed workspace configuration (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` or ``:16:8``) before its
first call, or torch raises when deterministic algorithms are on (torch 2.13 may no longer check it, but TorchTitan
still sets it and it is harmless), and cuDNN must not pick kernels by benchmarking.
"""

from __future__ import annotations

import os

import torch

DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
"""The workspace configurations cuBLAS is deterministic with."""


def enable_determinism(device: torch.device) -> None:
    """Deterministic algorithms everywhere; on CUDA also a deterministic cuBLAS workspace (set before any matmul;
    a valid value already in the environment is kept) and cuDNN without autotuning."""
    if device.type == "cuda":
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in DETERMINISTIC_CUBLAS:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CUBLAS[0]
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
