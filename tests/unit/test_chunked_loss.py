"""Chunked loss (model/loss.py): the same loss and gradients as the full-logits loss."""

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


def test_ignored_labels_are_left_out_of_the_mean() -> None:
    """Labels equal to -100 (F.cross_entropy's ignore_index) count in neither the sum nor the token count."""
    from meshforge.model.loss import IGNORE_INDEX, chunked_cross_entropy

    torch.manual_seed(0)
    head, hidden = torch.nn.Linear(16, 50), torch.randn(2, 12, 16)
    labels = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    labels[0, :5] = IGNORE_INDEX
    want = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(0, 1))
    got = chunked_cross_entropy(head, hidden, labels, chunks=4)
    assert abs(got.item() - want.item()) <= 1e-6, f"{got.item()} vs {want.item()}: ignored labels counted in the mean"


def test_no_chunk_logits_are_kept_for_backward() -> None:
    """What the forward saves for backward (seen by a saved-tensors hook outside the chunks' recomputation) holds no
    logits: each chunk's are recomputed in backward, so the full (tokens x vocab) tensor never exists."""
    from meshforge.model.loss import chunked_cross_entropy

    vocab, saved = 512, []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    head, hidden = torch.nn.Linear(16, vocab), torch.randn(2, 24, 16, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 24))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_cross_entropy(head, hidden, labels, chunks=4)
    loss.backward()
    logits = [s for s in saved if s and s[-1] == vocab]
    assert saved and not logits, f"chunk logits kept for backward (no recomputation): {logits}"
