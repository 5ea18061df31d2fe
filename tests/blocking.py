"""A second, equally valid float32 blocking of every matmul: the noise floor a parity tolerance is derived from.

On a CPU the losses of a parallel layout differ from one process's by how its BLAS blocks each matmul: AMD EPYC
machines run oneMKL's generic kernels, where a column shard of a matmul gives the same bits as the whole matmul, and
Intel Xeons run oneMKL's own kernels, whose blocking follows the output width, so 1-6 % of a column shard's outputs
differ from the whole matmul's in their last bit (scripts in docs/benchmarks/cpu-parity-noise.md). A float32 run
absorbs that; a Float8 run does not: a last-bit change moves a value across a Float8 rounding boundary, and AdamW's
first update turns the changed gradient of a near-zero weight into a step of the full learning rate.

``KSplitMatmul`` runs every ``aten.mm`` / ``addmm`` / ``bmm`` of a process as the sum of ``parts`` matmuls over slices
of the reduced dimension: the same product summed in another order, on any CPU. The difference between a run under it
and the same run without it is that run's own noise floor, measured where the test runs.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _split_mm(a: torch.Tensor, b: torch.Tensor, parts: int) -> torch.Tensor:
    """``a @ b`` (2-D or batched): its output columns in two halves (as a column-parallel layer computes them), each
    the sum of ``parts`` products over slices of the reduced dimension (as a row-parallel layer's all-reduce sums)."""
    n = b.shape[-1]
    if n >= 2:
        return torch.cat([_ksplit_mm(a, b[..., : n // 2], parts), _ksplit_mm(a, b[..., n // 2 :], parts)], dim=-1)
    return _ksplit_mm(a, b, parts)


def _ksplit_mm(a: torch.Tensor, b: torch.Tensor, parts: int) -> torch.Tensor:
    """``a @ b`` as the sum of ``parts`` products over slices of the reduced dimension."""
    k = a.shape[-1]
    mm = aten.bmm.default if a.dim() == 3 else aten.mm.default
    if k < parts:
        return mm(a, b)
    slices = list(itertools.pairwise(k * i // parts for i in range(parts + 1)))
    out = mm(a[..., slices[0][0] : slices[0][1]], b[..., slices[0][0] : slices[0][1], :])
    for lo, hi in slices[1:]:
        out = out + mm(a[..., lo:hi], b[..., lo:hi, :])
    return out


class KSplitMatmul(TorchDispatchMode):
    """Every mm / addmm / bmm on plain tensors summed over ``parts`` slices of its reduced dimension."""

    def __init__(self, parts: int = 2) -> None:
        super().__init__()
        self.parts = parts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(t is not torch.Tensor for t in types):
            return NotImplemented  # a tensor subclass (Float8, DTensor) first: its plain matmuls come back here
        if func in (aten.mm.default, aten.bmm.default) and not kwargs:
            return _split_mm(args[0], args[1], self.parts)
        if func is aten.addmm.default:
            bias, a, b = args
            product = _split_mm(a, b, self.parts)
            return kwargs.get("beta", 1) * bias + kwargs.get("alpha", 1) * product if kwargs else bias + product
        return func(*args, **kwargs)
