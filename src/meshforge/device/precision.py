"""``training.mixed_precision_param = "auto"``: the dtype a run computes in, chosen for the device it runs on.

bf16 on CUDA (every GPU meshforge targets has bf16 tensor cores); on a CPU the faster of float32 and bfloat16 by the
cached matmul probe (device/peak.py): CPUs without bf16 matmul units (AVX-512 BF16 / AMX) run bf16 many times slower
than float32. Any explicit choice is used as given.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from meshforge.device.dtypes import DTYPES
from meshforge.device.peak import faster_cpu_dtype


def resolve_param_dtype(requested: str, device: torch.device) -> tuple[str, str]:
    """The dtype name a run uses for ``requested`` on ``device``, and a sentence saying how it was chosen."""
    if requested != "auto":
        return requested, "as configured"
    if device.type == "cpu":
        name, why = faster_cpu_dtype()
        return name, f"auto: the faster on this CPU ({why})"
    return "bfloat16", f"auto: bfloat16 on {device.type}"


def autocast_context(dtype: str, device: torch.device, *, fsdp_enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Without FSDP nobody casts parameters: use autocast for bf16/fp16 runs (``dtype``: the resolved
    ``training.mixed_precision_param``)."""
    if fsdp_enabled or dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])
