"""Expert parallel: each MoE layer's routed experts split over the ``ep`` axis, tokens sent to their experts' ranks.

``apply_ep`` makes every routed-expert weight a DTensor ``Shard(0)`` on the ep mesh (rank r holds experts
[r x E/ep, (r + 1) x E/ep)), so checkpoints keep global expert shapes and reshard across EP degrees, and replaces the
layer's local dispatch with :class:`AllToAllDispatch`:

1. the per-expert counts of this rank's routed tokens are exchanged (an ``all_to_all_single`` of counts), so each
   rank knows how many rows it will receive from each peer for each of its experts;
2. the token rows (already grouped by expert, hence by destination rank) travel by ``all_to_all_single`` with uneven
   splits, differentiable (``all_to_all_single_autograd``: backward sends the gradients the reverse way);
3. the received rows, ordered (source rank, local expert), are regrouped expert-major, the local experts run, the
   order is restored and the results travel back.

FSDP then shards the experts over the ranks left after EP (``efsdp``, parallel/fsdp.py) and averages their gradients
there; an expert's gradient sums the tokens of all its ep peers, so the experts scale it by 1 / ep (``grad_scale``):
the result is the data-parallel mean, as for every other parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from meshforge.model.moe import GroupedExperts, moe_layers


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard the routed experts of every MoE layer of ``model`` over ``ep_mesh`` and dispatch tokens by all-to-all."""
    for moe in moe_layers(model):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.grad_scale = 1.0 / ep_mesh.size()
        moe.dispatch = AllToAllDispatch(experts, ep_mesh)


class AllToAllDispatch:
    """(token rows grouped by global expert id, counts per global expert) -> the experts' outputs, same order."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
        self.experts, self.group, self.ep = experts, ep_mesh.get_group(), ep_mesh.size()

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # (ep x local experts): peers' rows for me
        per_source = received_counts.view(self.ep, -1)  # (source rank, local expert)
        input_splits = counts.view(self.ep, -1).sum(dim=1).tolist()
        output_splits = per_source.sum(dim=1).tolist()
        received = _waited(all_to_all_single_autograd(x, output_splits, input_splits, self.group))
        order = expert_major_order(per_source, sum(output_splits))
        out = self.experts(received[order], per_source.sum(dim=0))
        out = out[torch.argsort(order)]  # back to (source rank, local expert) order
        return _waited(all_to_all_single_autograd(out, input_splits, output_splits, self.group))


def expert_major_order(per_source: torch.Tensor, rows: int) -> torch.Tensor:
    """Row order that turns rows laid out (source rank, local expert) into (local expert, source rank), each segment
    keeping its rows' order: per_source (ranks, local experts) holds the segment sizes, ``rows`` their sum (known on
    the host from the all-to-all's splits: without it CUDA would read the sum back)."""
    ranks, local = per_source.shape
    ids = torch.arange(ranks * local, device=per_source.device)
    segment = torch.repeat_interleave(ids, per_source.flatten(), output_size=rows)
    key = (segment % local) * ranks + segment // local
    return torch.argsort(key, stable=True)


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t
