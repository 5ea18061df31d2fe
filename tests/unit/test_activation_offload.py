"""Activation offload (parallel/activation_offload.py): on a CPU the pack really copies into a buffer of its own and
unpack returns that copy, so these tests see a wrong unpack (zeros, a stale or aliased buffer); with it, the loss and
gradients are bitwise those of the run without offload, in every AC mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from meshforge.config.schema import ActivationCheckpoint
from meshforge.model.flavors import get_flavor
from meshforge.model.llama import build_model
from meshforge.parallel.activation_ckpt import apply_ac
from meshforge.parallel.activation_offload import HostCopyOffload, is_weight, offload_context


def loss_and_grads(mode: str, offload: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    model = build_model(dataclasses.replace(get_flavor("tiny"), n_layers=2))
    apply_ac(model, ActivationCheckpoint(mode=mode))  # type: ignore[arg-type]
    model.to_empty(device="cpu")
    model.init_weights(0)
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    hooks = offload_context(offload, torch.device("cpu"))
    assert isinstance(hooks, HostCopyOffload) == offload
    unpacked = []
    if offload:  # count the saved tensors coming back from their host copies
        unpack = hooks.unpack_hook  # type: ignore[attr-defined]
        hooks.unpack_hook = lambda packed: unpacked.append(1) or unpack(packed)  # type: ignore[attr-defined]
    with hooks:
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten(0, 1))
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], len(unpacked)  # type: ignore[misc]


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_offload_is_bitwise_identical(mode: str) -> None:
    want_loss, want, none_unpacked = loss_and_grads(mode, offload=False)
    got_loss, got, unpacked = loss_and_grads(mode, offload=True)
    assert none_unpacked == 0 and unpacked > 0  # backward read its saved tensors back from the host copies
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_pack_copies_into_a_buffer_of_its_own() -> None:
    """A change of the storage after the forward must not reach backward: the saved value is the copy made at pack
    (``tensor.cpu()`` on a CPU tensor is the tensor itself: an aliasing pack gives the changed value). Written through
    ``.data``, as a reuse of the memory would, unseen by the version counter."""
    x = torch.arange(4.0)
    w = torch.ones(4, requires_grad=True)
    with offload_context(True, torch.device("cpu")):
        y = (x * w).sum()  # saves x for w's gradient
    x.data.add_(10.0)  # the activation's storage reused after the forward
    y.backward()
    assert torch.equal(w.grad, torch.arange(4.0))  # type: ignore[arg-type]


def test_an_in_place_write_after_pack_raises_as_autograd_does_without_hooks() -> None:
    """Autograd's hooks skip its check that a saved tensor was not modified in place; offload keeps the rule (on CUDA
    the write would race the copy out), on the CPU path too, so CPU runs catch such model code."""
    w = torch.ones(4, requires_grad=True)
    for offload, message in ((False, "needed for gradient computation has been modified"), (True, "after the forward")):
        x = torch.arange(4.0)
        with offload_context(offload, torch.device("cpu")):
            y = (x * w).sum()  # saves x for w's gradient
        x.add_(10.0)
        with pytest.raises(RuntimeError, match=message):
            y.backward()


def test_weights_stay_and_activations_go() -> None:
    """A matmul saves its weight (``weight.t()``; under autocast a bf16 copy of it): never offloaded, the parameter
    itself comes back; the input (an activation) goes through a host copy."""
    linear = torch.nn.Linear(4, 3, bias=False)
    x = torch.randn(2, 4, requires_grad=True)
    for autocast in (False, True):
        packed: list[object] = []
        hooks = saved_tensors_hooks(lambda t, out=packed: out.append(HostCopyOffload.pack(t)) or out[-1], lambda p: p)
        with hooks, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            linear(x * 2).sum()  # saves x * 2 (cast under autocast) and the weight, transposed (and cast)
        kept = [p for p in packed if isinstance(p, torch.Tensor)]
        moved = [p for p in packed if isinstance(p, tuple)]
        assert len(kept) == 1 and is_weight(kept[0]) and kept[0].shape == (4, 3), (autocast, packed)
        assert len(moved) == 1 and moved[0][1].shape == (2, 4), (autocast, packed)


def test_per_op_sac_keeps_its_own_hooks_inside_blocks() -> None:
    """Per-op selective AC's cached op outputs stay with the checkpoint (its hooks are innermost): fewer tensors come
    back through the offload than without AC, and the results are still bitwise equal (above)."""
    _, _, plain = loss_and_grads("none", offload=True)
    _, _, selective = loss_and_grads("selective", offload=True)
    assert 0 < selective < plain


def test_dtensor_activations_are_offloaded_and_rebuilt() -> None:
    """Under TP / SP the saved activations are DTensors: pack copies their local shard into a host buffer of its own
    and unpack rebuilds the DTensor (a plain host buffer copied from a DTensor raised "mixed torch.Tensor and
    DTensor" in the composability matrix's TP + offload job)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from tests.fakeworld import fake_rank

    with fake_rank(0, 1):
        mesh = init_device_mesh("cpu", (1,))
        x = DTensor.from_local(torch.arange(4.0), mesh, [Replicate()])
        w = DTensor.from_local(torch.ones(4), mesh, [Replicate()]).requires_grad_()
        hooks = offload_context(True, torch.device("cpu"))
        packed: list[object] = []
        pack = hooks.pack_hook  # type: ignore[attr-defined]
        hooks.pack_hook = lambda t: packed.append(pack(t)) or packed[-1]  # type: ignore[attr-defined]
        with hooks:
            y = (x * w).sum()  # saves x (a DTensor) for w's gradient
        x._local_tensor.data.add_(10.0)  # the activation's storage reused after the forward
        y.backward()
        assert any(isinstance(p, tuple) and p[2] is not None for p in packed)  # a DTensor went to the host
        assert isinstance(w.grad, DTensor)
        assert torch.equal(w.grad.to_local(), torch.arange(4.0))
