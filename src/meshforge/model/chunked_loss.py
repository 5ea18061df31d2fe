"""Chunked loss: the output projection and the cross-entropy over N chunks of tokens, each chunk's logits recomputed
in backward (``torch.utils.checkpoint``), so the full (tokens x vocab) logits, their float32 copy and their gradient
never exist at once: at most one chunk's. The loss is the same mean token cross-entropy as train/loop.py's (sums of
chunks over the count of labelled tokens; equal to it up to float rounding of the summation order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshforge.errors import ConfigError

IGNORE_INDEX = -100  # F.cross_entropy's default, kept so that the mean is over the same tokens


def _chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed float32 cross-entropy of one chunk: hidden (tokens, dim), labels (tokens,)."""
    return F.cross_entropy(head(hidden).float(), labels, reduction="sum")


def chunked_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunks: int) -> torch.Tensor:
    """Mean token cross-entropy of ``head(hidden)`` against labels: hidden (batch, seq, dim), labels (batch, seq)."""
    flat_hidden, flat_labels = hidden.flatten(0, 1), labels.flatten(0, 1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for part, target in zip(flat_hidden.chunk(chunks), flat_labels.chunk(chunks), strict=True):
        total = total + checkpoint(_chunk_loss_sum, head, part, target, use_reentrant=False)
    return total / (flat_labels != IGNORE_INDEX).sum()


def check_loss_chunks(chunks: int, *, tp: int, pp: int) -> None:
    """Refuse the layouts the chunked loss does not run on yet, one line each."""
    if chunks == 1:
        return
    if tp > 1:
        raise ConfigError(
            f"training.loss_chunks = {chunks} with tensor_parallel_degree {tp}: not supported yet (the vocab-sharded "
            "output takes a sequence-sharded DTensor that is not sliced into token chunks); use loss_chunks 1"
        )
    if pp > 1:
        raise ConfigError(
            f"training.loss_chunks = {chunks} with pipeline_parallel_degree {pp}: not supported yet (the last "
            "stage's loss is the schedule's loss_fn on full logits); use loss_chunks 1"
        )
