"""Ring attention: K/V blocks pass rank to rank over the cp group; each step's partial attention merges by LSE.

cp rank ``r`` holds query and K/V chunks ``(r, 2cp-1-r)`` (head-tail layout, ``api.py``). At step ``s`` it
holds the K/V of rank ``r - s`` and, while it attends to them, already sends them on to ``r + 1`` and receives the
next block from ``r - 1`` (``dist.batch_isend_irecv``; gloo on CPU, NCCL on CUDA). A query chunk attends to an earlier
K/V chunk unmasked, to its own chunk causally (step 0) and skips later ones. After ``cp`` steps every query has seen
the whole causal prefix while each rank held at most two K/V slices.

Backward (FlashAttention's, with the merged out and LSE; ``blocks.py``): K/V go round the ring again, each
rank adds its share of dK/dV to an fp32 accumulator that travels with the block, and after ``cp`` sends every
accumulator is back at the block's owner. Sends overlap the next block's compute in both directions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshforge.parallel.context_parallel.blocks import Partial, cat_seq_major, kernel_for

KV_TAG, GRAD_TAG = 0, 1


class Ring:
    """The cp group as a ring: this rank's place and its neighbours' global ranks."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensor: torch.Tensor, tag: int) -> tuple[list[Any], torch.Tensor]:
        """Start sending ``tensor`` to the next rank and receiving the previous rank's; (works, receive buffer)."""
        recv = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops), recv


def wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def step_pairs(rank: int, src: int, cp: int) -> list[tuple[int, int, bool]]:
    """(local query chunk, local K/V chunk, causal) pairs rank ``rank`` computes on the K/V of rank ``src``."""
    q_ids, kv_ids = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
    return [(i, m, qi == kj) for i, qi in enumerate(q_ids) for m, kj in enumerate(kv_ids) if kj <= qi]


def _chunk(t: torch.Tensor, index: int, size: int) -> torch.Tensor:
    return t[..., index * size : (index + 1) * size, :]


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring
    ) -> torch.Tensor:
        # q: (batch, heads, 2 x chunk, head_dim); k, v: (batch, kv_heads, 2 x chunk, head_dim)
        kernel, size = kernel_for(q.device, q.dtype), q.shape[2] // 2
        partials, auxes = [Partial(), Partial()], {}
        kv = torch.stack([k, v])  # (2, batch, kv_heads, 2 x chunk, head_dim): one message per step
        for step in range(ring.size):
            works, incoming = ring.shift(kv, KV_TAG) if step < ring.size - 1 else ([], kv)
            for i, m, causal in step_pairs(ring.rank, (ring.rank - step) % ring.size, ring.size):
                out, lse, auxes[step, i, m] = kernel.forward(
                    _chunk(q, i, size), _chunk(kv[0], m, size), _chunk(kv[1], m, size), causal
                )
                partials[i].add(out, lse)
            wait(works)
            kv = incoming
        out = cat_seq_major([p.out for p in partials if p.out is not None]).to(q.dtype)
        lse = torch.cat([p.lse for p in partials if p.lse is not None], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.auxes = ring, auxes  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        ring: Ring = ctx.ring  # type: ignore[attr-defined]
        kernel, size, dout = kernel_for(q.device, q.dtype), q.shape[2] // 2, dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        grad_works: list[Any] = []
        grad_in: torch.Tensor | None = None
        for step in range(ring.size):
            works, incoming = ring.shift(kv, KV_TAG) if step < ring.size - 1 else ([], kv)
            grad = torch.zeros_like(kv, dtype=torch.float32)  # this rank's share of the held block's dK/dV
            for i, m, causal in step_pairs(ring.rank, (ring.rank - step) % ring.size, ring.size):
                rows, cols = slice(i * size, (i + 1) * size), slice(m * size, (m + 1) * size)
                block_dq, dk, dv = kernel.backward(
                    dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out[:, :, rows],
                    lse[:, :, rows].contiguous(), ctx.auxes[step, i, m], causal,  # type: ignore[attr-defined]
                )  # fmt: skip
                dq[:, :, rows] += block_dq
                grad[0][:, :, cols] += dk
                grad[1][:, :, cols] += dv
            wait(grad_works)
            if grad_in is not None:  # the shares of the ranks that held this block before
                grad += grad_in
            grad_works, grad_in = ring.shift(grad, GRAD_TAG)
            wait(works)
            kv = incoming
        wait(grad_works)
        assert grad_in is not None
        return dq.to(q.dtype), grad_in[0].to(k.dtype), grad_in[1].to(v.dtype), None


class RingAttention(nn.Module):
    """Causal attention of local queries with K/V passed around the cp ring (replaces ``CausalSDPA``)."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.cp_mesh = cp_mesh
        self.ring: Ring | None = None  # built at the first forward: the process group exists by then

    @torch.compiler.disable  # point-to-point sends inside an autograd.Function: eager (check_cp_impl refuses compile)
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (batch, heads, local_seq, head_dim); k, v: (batch, kv_heads, local_seq, head_dim)
        if self.ring is None:
            self.ring = Ring(self.cp_mesh.get_group())
        return _RingAttentionFn.apply(q.contiguous(), k.contiguous(), v.contiguous(), self.ring)  # type: ignore[no-any-return]
