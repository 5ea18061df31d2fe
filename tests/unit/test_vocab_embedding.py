"""The token embedding's gradient on tensor-parallel ranks is its vocabulary shard's (parallel/vocab_embedding.py):
DTensor's own backward in torch 2.13 computes the full ``vocab x dim`` gradient, replicated, on every TP rank. Rank 0
of a fake 2-rank TP group (shapes only; the values against one process: a 2-rank gloo check in the commit message and
tests/distributed/test_tp_cp_parity.py's TP layouts), sequence-parallel and replicated outputs, even and odd
vocabularies."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fakeworld import fake_rank
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from meshforge.parallel.tensor_parallel import EmbeddingParallel

DIM = 16


class Backward(TorchDispatchMode):
    """The shapes ``embedding_dense_backward`` produces."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.embedding_dense_backward.default:
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("vocab,output", [(64, Shard(1)), (63, Shard(1)), (64, Replicate())])
def test_the_embedding_gradient_is_the_vocabulary_shard(vocab: int, output: Any) -> None:
    with fake_rank(0, 2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        emb = parallelize_module(nn.Embedding(vocab, DIM), mesh, EmbeddingParallel(output_layouts=output))
        shard = tuple(emb.weight.to_local().shape)
        out = emb(torch.randint(0, vocab, (2, 8)))
        with Backward() as seen:
            out.sum().backward()
        grad = emb.weight.grad
    assert shard == (-(-vocab // 2), DIM)
    assert seen.shapes == [shard], f"the embedding's backward computed {seen.shapes}, not the shard {shard}"
    assert grad.placements == (Shard(0),) and tuple(grad.to_local().shape) == shard, (grad.placements, shard)
