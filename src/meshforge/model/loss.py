"""The training loss, in one place: the mean token cross-entropy (float32), its chunked form and the loss-parallel
entry under tensor parallel. Training (train/loop.py, train/validate.py), the pipeline's last stage and the exact
memory run (tools/memory_run.py, tools/memory_pp.py) all take their loss from here.

Chunked loss: the output projection and the cross-entropy over N chunks of tokens, each chunk's logits recomputed in
backward (``torch.utils.checkpoint``), so the full (tokens x vocab) logits, their float32 copy and their gradient never
exist at once: at most one chunk's. It is the same mean token cross-entropy as :func:`cross_entropy` (sums of chunks
over the count of labelled tokens; equal to it up to float rounding of the summation order).

Under tensor parallel the final hidden states arrive sequence-sharded (a ``Shard(1)`` DTensor under sequence
parallel): they are gathered once, as the output projection's own input redistribution would, and each token chunk
(a replicated DTensor) goes through the column-sharded output projection; under loss parallel its logits stay
vocab-sharded and the cross-entropy is torch's vocab-parallel one (:func:`loss_parallel_context` is active around
forward and backward in train/loop.py), so no rank ever holds more than (tokens / N) x (vocab / tp) logits. Under
pipeline parallel the last stage's forward gets the labels as a keyword and returns this loss
(parallel/pipeline/stage.py), so the projection runs inside the stage (and inside FSDP's forward, with the output
weight gathered)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # F.cross_entropy's default, kept so that the mean is over the same tokens


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in float32: logits (batch, seq, vocab), labels (batch, seq)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Around the loss and its backward: cross-entropy on vocab-sharded logits without gathering them."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def _chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed float32 cross-entropy of one chunk: hidden (tokens, dim), labels (tokens,)."""
    loss = F.cross_entropy(head(hidden).float(), labels, reduction="sum")
    return loss.to_local() if isinstance(loss, DTensor) else loss  # loss parallel: a replicated scalar


def chunked_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunks: int) -> torch.Tensor:
    """Mean token cross-entropy of ``head(hidden)`` against labels: hidden (batch, seq, dim), labels (batch, seq)."""
    if isinstance(hidden, DTensor):  # sequence parallel: (batch, seq / tp, dim) shards -> the whole sequence
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    flat_hidden, flat_labels = hidden.flatten(0, 1), labels.flatten(0, 1)
    total = torch.zeros((), dtype=torch.float32, device=labels.device)
    for part, target in zip(flat_hidden.chunk(chunks), flat_labels.chunk(chunks), strict=True):
        total = total + checkpoint(_chunk_loss_sum, head, part, target, use_reentrant=False)
    return total / (flat_labels != IGNORE_INDEX).sum()
