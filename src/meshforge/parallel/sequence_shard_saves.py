"""Sequence parallel's column-parallel inputs saved as the sequence shard (Megatron's scheme).

Under sequence parallel the attention's and the feed-forward's input arrives sequence-sharded and is all-gathered
before wq/wk/wv (w1/w3); DTensor's ColwiseParallel matmuls then save the gathered input, tp times the shard, once per
block and input (2 x 128 MiB per block-micro-batch at NeMo's 405B layout, against 2 x 16 for the shard). Here one
autograd function does the all-gather and the column-parallel matmuls that share it, saves the shard and all-gathers
it again in backward (one more all-gather per input per backward; no matmul is recomputed), and reduce-scatters the
input's gradient, as Megatron's sequence-parallel linear layers do.

The projections' weights stay ColwiseParallel DTensors (their sharding, FSDP, checkpoints and the gradient norm are
unchanged); only the matmuls are called through ``gathered_projections`` instead of each linear's forward. Used for
the dense blocks without Float8 and without projection biases (parallel/tensor_parallel.py picks them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

SEQ_DIM = 1  # (batch, seq, dim)


class _GatheredLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, mesh: DeviceMesh, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.dtypes = (shard.dtype, *(w.dtype for w in weights))
        shard, *cast = autocast_inputs(shard, *weights)  # backward runs outside autocast: it gets the cast operands
        gathered = gather(shard, mesh)  # (batch, seq, dim)
        ctx.save_for_backward(shard, *cast)
        ctx.mesh = mesh
        return tuple(F.linear(gathered, w) for w in cast)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        shard, *weights = ctx.saved_tensors
        grads = tuple(g.to(shard.dtype) for g in grads)
        gathered = gather(shard, ctx.mesh).flatten(0, -2)  # (tokens, dim), gathered again
        grad_weights = [(g.flatten(0, -2).t() @ gathered).to(d) for g, d in zip(grads, ctx.dtypes[1:], strict=True)]
        grad_input = grads[0] @ weights[0]
        for g, w in zip(grads[1:], weights[1:], strict=True):
            grad_input = grad_input + g @ w
        grad_shard = funcol.reduce_scatter_tensor(grad_input.contiguous(), "sum", scatter_dim=SEQ_DIM, group=ctx.mesh)
        return (funcol.wait_tensor(grad_shard).to(ctx.dtypes[0]), None, *grad_weights)


def autocast_inputs(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` in autocast's compute dtype where autocast is on for their device (a run without FSDP in bf16 /
    fp16, device/precision.py), as autocast would cast a matmul's operands; unchanged otherwise."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return list(tensors)
    dtype = torch.get_autocast_dtype(device)
    return [t.to(dtype) if t.is_floating_point() else t for t in tensors]


def gather(shard: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The shards of the tp group concatenated along the sequence (``all_gather_single`` where torch has it, 2.12+;
    its predecessor ``all_gather_tensor`` before)."""
    all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return funcol.wait_tensor(all_gather(shard.contiguous(), gather_dim=SEQ_DIM, group=mesh))


class GatheredProjections:
    """``project(x, linears)``: the column-parallel outputs (local shards, as ColwiseParallel's use_local_output
    gives them) of the sequence-sharded DTensor ``x`` through ``linears``, saving the shard (module docstring)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def __call__(self, x: torch.Tensor, linears: list[nn.Linear]) -> tuple[torch.Tensor, ...]:
        shard = x.to_local()  # type: ignore[attr-defined]
        weights = [linear.weight.to_local() for linear in linears]  # type: ignore[attr-defined]
        return _GatheredLinears.apply(shard, self.mesh, *weights)  # type: ignore[no-any-return]
