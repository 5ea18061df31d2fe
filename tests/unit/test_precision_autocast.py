"""device/precision.py's autocast rule (training and validation share it): autocast only where nobody casts the
parameters, i.e. without FSDP, and only for a 16-bit compute dtype."""

from __future__ import annotations

import contextlib

import torch

from meshforge.device.precision import autocast_context

CPU = torch.device("cpu")


def test_autocast_only_without_fsdp_and_for_16_bit() -> None:
    ctx = autocast_context("bfloat16", CPU, fsdp_enabled=False)
    assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16 and ctx.device == "cpu"
    with ctx:
        out = torch.ones(2, 2) @ torch.ones(2, 2)
    assert out.dtype == torch.bfloat16
    assert isinstance(autocast_context("bfloat16", CPU, fsdp_enabled=True), contextlib.nullcontext), "FSDP casts"
    assert isinstance(autocast_context("float32", CPU, fsdp_enabled=False), contextlib.nullcontext)
