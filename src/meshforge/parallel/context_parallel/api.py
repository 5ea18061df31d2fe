"""Context parallel's entry points and its all-gather implementation: the implementation checks, the head-tail
layout (positions, chunk order), the attention core that all-gathers K/V over the cp group, ``apply_cp`` and
``shard_batch``. The overview is the package's docstring (``parallel/context_parallel/__init__.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from meshforge.config.io import ConfigError
from meshforge.parallel.context_parallel.blocks import Block, attend, attend_backward, cat_seq_major, kernel_for
from meshforge.parallel.context_parallel.ring import RingAttention
from meshforge.parallel.local_ranks import each_rank

IMPLS = ("allgather", "ring")


def all_gather_autograd(tensor: torch.Tensor, gather_dim: int, group: DeviceMesh) -> torch.Tensor:
    """All-gather with a backward (reduce-scatter of the gradient): ``all_gather_single_autograd`` where torch has it
    (2.12+), else its predecessor ``all_gather_tensor_autograd`` (torch 2.11), probed, not pinned."""
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(tensor, gather_dim=gather_dim, group=group)  # type: ignore[no-any-return]


def resolve_cp_impl(impl: str, device_type: str) -> str:
    """``auto`` -> ``allgather`` on every device (fewer, larger collectives; both are parity-tested on CPU).

    ``device_type`` is kept for the callers' symmetry: neither implementation needs a particular device."""
    if impl == "auto":
        return "allgather"
    if impl not in IMPLS:
        raise ConfigError(f"parallelism.context_parallel_impl = {impl!r} is unknown; use 'auto', 'allgather' or 'ring'")
    return impl


def check_cp_impl(impl: str, device_type: str, *, compile_enabled: bool) -> None:
    """Refuse what cannot run: the ring's point-to-point sends inside an autograd.Function cannot be traced into the
    blocks' full graphs."""
    if resolve_cp_impl(impl, device_type) == "ring" and compile_enabled:
        raise ConfigError(
            "parallelism.context_parallel_impl = 'ring' cannot run inside compiled blocks (compile.enable = true; "
            "its point-to-point sends do not trace); use 'allgather' or 'auto', or set compile.enable = false"
        )


@each_rank
def load_balanced_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of the tokens cp rank ``rank`` holds: chunks ``rank`` and ``2cp - 1 - rank`` of ``2cp``."""
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([head, tail])


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The global chunk indices (of ``2 x cp``) that cp rank ``rank`` holds, in local order."""
    return rank, 2 * cp - 1 - rank


def global_chunk_order(cp: int) -> list[int]:
    """Indices into the gathered chunks (rank order: rank 0 head, rank 0 tail, rank 1 head, ...) of chunks 0..2cp-1."""
    return [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]


def _prefix_ranges(chunk: int, size: int) -> list[tuple[int, int, bool]]:
    """Key ranges query chunk ``chunk`` attends to in the global-order sequence: all earlier chunks, then itself."""
    ranges = [(0, chunk * size, False)] if chunk else []
    return [*ranges, (chunk * size, (chunk + 1) * size, True)]


@each_rank  # one slice per cp rank: under --local-ranks, once per simulated rank (parallel/local_ranks.py)
def _gathered_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, cp: int
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """(out, fp32 lse, each chunk's aux) of this rank's query chunks against the global-order K/V."""
    # q: (batch, heads, 2 x chunk, head_dim), chunks (rank, 2cp-1-rank); k, v: (batch, kv_heads, seq, head_dim)
    kernel, size = kernel_for(q.device, q.dtype), q.shape[2] // 2
    outs, lses, auxes = [], [], []
    for i, chunk in enumerate(chunk_ids(rank, cp)):
        ranges = _prefix_ranges(chunk, size)
        blocks = [Block(k[:, :, a:b], v[:, :, a:b], causal) for a, b, causal in ranges]
        out, lse, aux = attend(kernel, q[:, :, i * size : (i + 1) * size], blocks)
        outs.append(out)
        lses.append(lse)
        auxes.append(aux)
    return cat_seq_major(outs), torch.cat(lses, dim=2), auxes  # wo's input is a view of it (blocks.py)


@each_rank
def _gathered_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    auxes: list[Any], rank: int, cp: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) of ``_gathered_forward``."""
    kernel, size, dout = kernel_for(q.device, q.dtype), q.shape[2] // 2, dout.contiguous()
    dq, dk, dv = [], torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for i, chunk in enumerate(chunk_ids(rank, cp)):
        rows = slice(i * size, (i + 1) * size)
        ranges = _prefix_ranges(chunk, size)
        blocks = [Block(k[:, :, a:b], v[:, :, a:b], causal) for a, b, causal in ranges]
        chunk_dq, dkv = attend_backward(
            kernel, dout[:, :, rows], q[:, :, rows], blocks, out[:, :, rows], lse[:, :, rows].contiguous(), auxes[i]
        )
        dq.append(chunk_dq)
        for (a, b, _), (block_dk, block_dv) in zip(ranges, dkv, strict=True):
            dk[:, :, a:b] += block_dk
            dv[:, :, a:b] += block_dv
    return torch.cat(dq, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _GatheredKVAttention(torch.autograd.Function):
    """Local query chunks against the whole (gathered, global-order) K/V, merged by LSE; exact backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, cp: int
    ) -> torch.Tensor:
        out, lse, auxes = _gathered_forward(q, k, v, rank, cp)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.auxes, ctx.rank, ctx.cp = auxes, rank, cp  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        args = ctx.auxes, ctx.rank, ctx.cp  # type: ignore[attr-defined]
        dq, dk, dv = _gathered_backward(dout, q, k, v, out, lse, *args)
        return dq, dk, dv, None, None


class AllGatherKVAttention(nn.Module):
    """Causal attention of local queries against K/V all-gathered over the cp group (replaces ``CausalSDPA``)."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.cp_mesh = cp_mesh
        self.cp_size, self.cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (batch, heads, local_seq, head_dim); k, v: (batch, kv_heads, local_seq, head_dim), gathered in rank order
        k_all = all_gather_autograd(k.contiguous(), gather_dim=2, group=self.cp_mesh)
        v_all = all_gather_autograd(v.contiguous(), gather_dim=2, group=self.cp_mesh)
        order = global_chunk_order(self.cp_size)
        k_seq = k_all.unflatten(2, (2 * self.cp_size, -1))[:, :, order].flatten(2, 3)  # global order
        v_seq = v_all.unflatten(2, (2 * self.cp_size, -1))[:, :, order].flatten(2, 3)
        out = _GatheredKVAttention.apply(q.contiguous(), k_seq, v_seq, self.cp_rank, self.cp_size)
        return out  # type: ignore[no-any-return]


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, impl: str) -> None:
    """Make every block's attention core context-parallel (``impl`` resolved: 'allgather' or 'ring')."""
    layers: nn.ModuleDict = model.layers  # type: ignore[assignment]
    for block in layers.values():
        core = AllGatherKVAttention(cp_mesh) if impl == "allgather" else RingAttention(cp_mesh)
        block.attention.sdpa = core  # type: ignore[union-attr]


def shard_batch(
    cp_mesh: DeviceMesh | None, impl: str, inputs: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's (inputs, labels, global positions) of a batch (batch, seq); positions None without cp.

    Both implementations use the same head-tail layout (``impl`` is kept for the callers)."""
    if cp_mesh is None:
        return inputs, labels, None
    positions = load_balanced_positions(inputs.shape[1], cp_mesh.size(), cp_mesh.get_local_rank(), inputs.device)
    return inputs[:, positions], labels[:, positions], positions
