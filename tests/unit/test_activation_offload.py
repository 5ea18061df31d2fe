"""Activation offload (parallel/activation_offload.py): bitwise the same loss and gradients, in every AC mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshforge.config.schema import ActivationCheckpoint
from meshforge.model.flavors import get_flavor
from meshforge.model.llama import build_model
from meshforge.parallel.activation_ckpt import apply_ac
from meshforge.parallel.activation_offload import offload_context


def loss_and_grads(mode: str, offload: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = build_model(dataclasses.replace(get_flavor("tiny"), n_layers=2))
    apply_ac(model, ActivationCheckpoint(mode=mode))  # type: ignore[arg-type]
    model.to_empty(device="cpu")
    model.init_weights(0)
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    unpacked = []
    hooks = offload_context(offload, torch.device("cpu"))
    if offload:  # count the saved tensors coming back from the host copy (hooks are registered on entering)
        unpack = hooks.unpack_hook  # type: ignore[attr-defined]
        hooks.unpack_hook = lambda packed: unpacked.append(1) or unpack(packed)  # type: ignore[attr-defined]
    with hooks:
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten(0, 1))
    loss.backward()
    assert bool(unpacked) == offload  # offload on: backward read its saved tensors back from the host
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_offload_is_bitwise_identical(mode: str) -> None:
    want_loss, want = loss_and_grads(mode, offload=False)
    got_loss, got = loss_and_grads(mode, offload=True)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
