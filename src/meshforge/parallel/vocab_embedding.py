"""The token embedding's lookup on its vocabulary shard (Megatron's VocabParallelEmbedding), so its weight gradient
stays the size of the shard on every tensor-parallel rank.

DTensor's embedding forward on a vocabulary-sharded weight (``Shard(0)``) is already a masked local lookup, but torch
2.13 keeps no vocabulary-sharded rule for its backward (``embedding_dense_backward``: column-sharded, batch-partial or
partial only): the output's gradient is all-gathered and every rank computes the full ``vocab x dim`` gradient,
replicated, which FSDP then holds unsharded (in fp32 under gradient accumulation) until it reshards it:
``tp`` times the shard (405B at TP 8: 7.8 GiB against 0.98). Here the lookup runs on local tensors: the token ids
outside this rank's rows are masked, the shard's rows looked up and zeroed there, and the result handed on as a
``Partial`` DTensor (summed by the style's output redistribution, reduce-scatter under sequence parallel, as before).
The weight's gradient is the local lookup's: ``(vocab / tp) x dim``, placed ``Shard(0)`` like the weight
(``DTensor.to_local``'s backward keeps the spec).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding whose weight is a DTensor sharded on the vocabulary over one mesh dimension (``vocab_parallel``
    swaps the class of a RowwiseParallel'd embedding to this one; the parameters and state-dict keys are unchanged)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        assert isinstance(weight, DTensor) and weight.device_mesh.ndim == 1, "a weight sharded over one mesh dim"
        local = weight.to_local()
        ids = tokens.to_local() if isinstance(tokens, DTensor) else tokens
        shifted = ids - row_offset(weight)
        outside = (shifted < 0) | (shifted >= local.shape[0])
        rows = F.embedding(shifted.masked_fill(outside, 0), local)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0)
        return DTensor.from_local(rows, weight.device_mesh, [Partial()], run_check=False)


def row_offset(weight: DTensor) -> int:
    """The first vocabulary row this rank holds (``Shard(0)``: torch.chunk's split, the last chunks may be short)."""
    rows, parts = weight.shape[0], weight.device_mesh.size()
    chunk = -(-rows // parts)
    return min(weight.device_mesh.get_local_rank() * chunk, rows)


def vocab_parallel(module: nn.Module) -> None:
    """Make a vocabulary-sharded nn.Embedding look up on its shard (module docstring). Left as DTensor runs it where
    the lookup has options this one does not implement (padding_idx, max_norm, sparse gradients)."""
    plain = type(module) is nn.Embedding
    if plain and module.padding_idx is None and module.max_norm is None and not module.sparse:  # type: ignore[union-attr]
        module.__class__ = VocabParallelEmbedding
