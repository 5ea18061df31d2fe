"""Lean saves: what the decoder's elementwise pieces keep for backward, without recomputing any matmul.

torch autograd differentiates RMSNorm and SwiGLU op by op and saves every op's inputs: a norm of a bf16 input keeps
two fp32 copies of it, its bf16 normalised output and rstd (5x the input's bytes); SwiGLU keeps silu's output beside
the two matmul outputs. The custom autograd functions here save what backward cannot cheaply recompute and redo the
elementwise rest in backward (Megatron's and the fused kernels' choice):

* ``rms_norm``: the input in its own dtype and rstd (fp32, one per row); backward recomputes the normalised input.
  The forward is bit-identical to the op-by-op norm; the backward computes in fp32 and casts once (the op-by-op one
  sums its two casts' gradients in the input's dtype), so it equals it in fp32 to rounding and is no less exact in
  bf16 (tests/unit/test_lean.py).
* ``silu_mul``: silu(a) * b saving a and b; backward recomputes silu(a) (one sigmoid per element) and runs the same
  aten ops autograd runs, so its gradients are bit-identical.

Both take DTensors (TP / SP: the ops inside follow DTensor's rules, as the op-by-op graph's do), run under
torch.compile (dynamo traces custom functions) and under activation checkpointing (their saves go through the
checkpoint's hooks like any op's).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd  # recomputed: the forward's fp32 normalised input, bit for bit
        grad32 = grad.float()
        grad_normed = grad32 * weight.float()  # (..., dim)
        # d/dx of x * rstd(x) = rstd * (g - normed * mean(g * normed))
        grad_x = (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True)) * rstd
        rows = tuple(range(grad.dim() - 1))
        grad_weight = (grad32 * normed.type_as(x)).sum(rows)  # the output's factor as the forward rounded it
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, saving the input and rstd (module docstring)."""
    return _RMSNorm.apply(x, weight, eps)  # type: ignore[no-any-return]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The op-by-op RMSNorm autograd differentiates (its saves: two fp32 copies of x, the output, rstd)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        grad_b = grad * F.silu(a)
        grad_a = torch.ops.aten.silu_backward(grad * b, a)
        return grad_a, grad_b


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate, silu(a) * b, saving a and b only (module docstring)."""
    return _SiluMul.apply(a, b)  # type: ignore[no-any-return]
