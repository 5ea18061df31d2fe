"""A freshly initialised model predicts near-uniformly: its first loss on random tokens is within 1.5 nats of
ln(vocab), tied output projection or not. The GPU check's Llama 3.2 1B (tied) started at 1,886 nats on the H200
(2026-12-04): the shared weight had the embedding's std 1, so the logits' std was sqrt(dim) (docs/benchmarks/gpu)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from meshforge.model.flavors import get_flavor
from meshforge.model.llama import Transformer
from meshforge.model.loss import cross_entropy


@pytest.mark.parametrize(("flavor", "tied"), [("debugmodel", False), ("debugmodel", True), ("1B", True)])
def test_first_loss_is_near_uniform(flavor: str, tied: bool) -> None:
    """The flavors' own shapes (the 1B: dim 2048, vocab 128,256, tied), two blocks deep to stay small on a CPU. A
    narrow tied model with a larger embedding std (dim^-0.5) starts at 14.7 nats: the residual stream is mostly the
    input token's embedding, so the tied output predicts the input token."""
    args = dataclasses.replace(get_flavor(flavor), n_layers=2, tie_embeddings=tied).with_seq_len(64)
    model = Transformer(args)
    model.init_weights(0)
    assert (model.output.weight is model.tok_embeddings.weight) is tied  # type: ignore[union-attr]
    tokens = torch.randint(0, args.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).item()
    assert abs(loss - math.log(args.vocab_size)) < 1.5, (flavor, loss, math.log(args.vocab_size))
