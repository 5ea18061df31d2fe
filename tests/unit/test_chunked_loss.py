"""Chunked loss (model/chunked_loss.py): the same loss and gradients as the full-logits loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshforge.model.flavors import get_flavor
from meshforge.model.llama import build_model


def loss_and_grads(chunks: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_flavor("tiny"), n_layers=2))
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.loss_chunks = chunks
    tokens = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(2))
    if chunks == 1:
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten(0, 1))
    else:
        loss = model(tokens, None, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunks", [3, 7])  # 7 does not divide 96 tokens: the last chunk is shorter
def test_chunked_loss_and_grads_match_full_logits(chunks: int) -> None:
    want_loss, want_grads = loss_and_grads(1)
    got_loss, got_grads = loss_and_grads(chunks)
    assert abs(got_loss.item() - want_loss.item()) <= 1e-6
    assert want_grads.keys() == got_grads.keys()
    for name, want in want_grads.items():
        torch.testing.assert_close(got_grads[name], want, rtol=0, atol=1e-6, msg=name)
