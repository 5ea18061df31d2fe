"""bf16 variants of every loss (issue 37: "bf16 paths tested only in fp32, where a missing .float() changes
nothing"): on a bf16 head the loss is computed in fp32, so it equals the fp32 cross-entropy of the same bf16 logits
to float rounding, and its dtype is float32. A bf16 cross-entropy differs in the third digit (a bf16 sum of a few
hundred token losses rounds to steps of 2-4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshforge.model.loss import IGNORE_INDEX, chunked_cross_entropy, cross_entropy


def bf16_case() -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """A bf16 head (64 -> vocab 512), bf16 hidden states (2 x 96 tokens) and labels with a few ignored."""
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 512, bias=False).to(torch.bfloat16)
    hidden = torch.randn(2, 96, 64, dtype=torch.bfloat16)
    labels = torch.randint(0, 512, (2, 96))
    labels[0, :5] = IGNORE_INDEX
    return head, hidden, labels


def fp32_reference(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean token cross-entropy of the bf16 logits, computed in float64 (then float32)."""
    logits = head(hidden).double()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1)).float()


def test_cross_entropy_of_bf16_logits_is_fp32() -> None:
    head, hidden, labels = bf16_case()
    with torch.no_grad():
        logits = head(hidden)
        got = cross_entropy(logits, labels)
    assert logits.dtype == torch.bfloat16 and got.dtype == torch.float32
    assert got.item() == pytest.approx(fp32_reference(head, hidden, labels).item(), rel=1e-6)


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_chunked_loss_on_a_bf16_head_is_fp32(chunks: int) -> None:
    head, hidden, labels = bf16_case()
    got = chunked_cross_entropy(head, hidden.requires_grad_(), labels, chunks)
    with torch.no_grad():
        want = fp32_reference(head, hidden, labels)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=1e-6), f"{chunks} chunks: {got.item()} vs {want.item()}"
    got.backward()  # the bf16 head's gradient equals the unchunked loss's
    grad = head.weight.grad
    assert grad is not None and grad.dtype == torch.bfloat16
    head.weight.grad = None
    cross_entropy(head(hidden), labels).backward()
    assert torch.allclose(grad.float(), head.weight.grad.float(), rtol=2e-2, atol=1e-4)
