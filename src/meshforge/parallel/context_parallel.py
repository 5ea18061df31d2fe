"""Context parallel: each of ``cp`` ranks holds a slice of every sequence; attention still sees the whole sequence.

Load balance (head-tail): the sequence is cut into ``2 x cp`` chunks and rank ``r`` holds chunks ``r`` and
``2cp - 1 - r``, so every rank gets the same share of the causal mask's work. Inputs, labels and the tokens' global
positions (for RoPE and the causal mask) are sliced the same way before the forward; the loss is a mean over the
local tokens, and FSDP over ``dp_shard_cp`` averages the gradients over cp (the mean of equal-size means).

Two implementations (``parallelism.context_parallel_impl``):

* ``allgather`` (any device, the default on CPU): each rank all-gathers K and V over the cp group (autograd
  reduce-scatters their gradients back) and runs SDPA of its local queries against the whole sequence with a causal
  mask built from global positions. Memory for K/V is that of the full sequence.
* ``ring`` (CUDA only, the default there): torch's ring attention (``torch.distributed.tensor.experimental``),
  which passes K/V blocks around the ring and merges partial softmaxes; K/V memory stays at the local slice. On CPU
  it fails (no CP sharding rule for ``_scaled_dot_product_flash_attention_for_cpu``), so it is refused there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh


def resolve_cp_impl(impl: str, device_type: str) -> str:
    """``auto`` -> ``allgather`` (proven against a single process on every device this project has tested);
    ``ring`` (torch's ring attention) is opt-in and CUDA-only; ``ring`` off CUDA is a user error."""
    if impl == "auto":
        return "allgather"
    if impl == "ring" and device_type != "cuda":
        raise ValueError(
            f"parallelism.context_parallel_impl = 'ring' needs CUDA (torch's ring attention has no {device_type} "
            "SDPA sharding rule); use 'allgather' or 'auto'"
        )
    return impl


def load_balanced_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of the tokens cp rank ``rank`` holds: chunks ``rank`` and ``2cp - 1 - rank`` of ``2cp``."""
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([head, tail])


class AllGatherKVAttention(nn.Module):
    """Causal attention of local queries against K/V all-gathered over the cp group (replaces ``CausalSDPA``)."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.cp_mesh = cp_mesh
        self.cp_size, self.cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def causal_mask(self, local_len: int, device: torch.device) -> torch.Tensor:
        """(local_len, cp x local_len) bool: query i may attend key j iff pos(key j) <= pos(query i)."""
        seq_len = local_len * self.cp_size
        q_pos = load_balanced_positions(seq_len, self.cp_size, self.cp_rank, device)
        k_pos = torch.cat([load_balanced_positions(seq_len, self.cp_size, r, device) for r in range(self.cp_size)])
        return q_pos[:, None] >= k_pos[None, :]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: (batch, heads, local_seq, head_dim); k, v gathered to (batch, heads, seq, head_dim) in rank order
        k_all = funcol.all_gather_single_autograd(k.contiguous(), gather_dim=2, group=self.cp_mesh)
        v_all = funcol.all_gather_single_autograd(v.contiguous(), gather_dim=2, group=self.cp_mesh)
        mask = self.causal_mask(q.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, impl: str) -> None:
    """Make every block's attention core context-parallel (``impl`` resolved: 'allgather' or 'ring')."""
    layers: nn.ModuleDict = model.layers  # type: ignore[assignment]
    blocks = list(layers.values())
    if impl == "allgather":
        for block in blocks:
            block.attention.sdpa = AllGatherKVAttention(cp_mesh)  # type: ignore[union-attr]
        return
    from torch.distributed.tensor.experimental._attention import (
        _ContextParallel,
        _enable_context_parallel_dispatcher,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    for block in blocks:
        parallelize_module(block.attention.sdpa, cp_mesh, style)  # type: ignore[union-attr, arg-type]
    _enable_context_parallel_dispatcher()  # DTensor SDPA -> ring attention (process-wide, as in TorchTitan)


def shard_batch(
    cp_mesh: DeviceMesh | None, impl: str, inputs: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's (inputs, labels, global positions) of a batch (batch, seq); positions None without cp."""
    if cp_mesh is None:
        return inputs, labels, None
    seq_len = inputs.shape[1]
    if impl == "allgather":
        positions = load_balanced_positions(seq_len, cp_mesh.size(), cp_mesh.get_local_rank(), inputs.device)
        return inputs[:, positions], labels[:, positions], positions
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _HeadTailLoadBalancer

    positions = torch.arange(seq_len, device=inputs.device)
    balancer = _HeadTailLoadBalancer(seq_len, cp_mesh.size(), inputs.device)
    local = _context_parallel_shard(cp_mesh, [inputs, labels, positions], [1, 1, 0], load_balancer=balancer)
    return local[0], local[1], local[2]  # type: ignore[return-value]
