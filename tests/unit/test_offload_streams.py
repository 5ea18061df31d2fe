"""Activation offload's CUDA path (parallel/activation_offload.py ``StreamOffload``, parallel/offload_pool.py) on a
CPU model of streams (tests/offload_stream_model.py: the side and prefetch streams run their copies as late as the
recorded order allows): the stream order is right when the model's late copies still give the gradients of a run
without offload, bitwise; a missing wait reads a NaN-filled buffer, a missing record_stream a freed tensor. Beside
that: the pinned pool holds exactly one micro-step's saved bytes and is reused, weights are never offloaded, backward
copies the next block's tensors back ahead on the prefetch stream, and a write after pack cannot race the copy."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from meshforge.config.schema import ActivationCheckpoint
from meshforge.model.flavors import get_flavor
from meshforge.model.llama import build_model
from meshforge.parallel.activation_ckpt import apply_ac
from meshforge.parallel.activation_offload import Saved, StreamOffload, blocks_of, is_weight
from meshforge.parallel.offload_pool import ALIGN, PinnedPool, aligned
from tests.offload_stream_model import SCHEDULES, ModelStreams, UseAfterFree, copies

CPU = torch.device("cpu")
LAYERS = 3


def tiny(mode: str) -> torch.nn.Module:
    model = build_model(dataclasses.replace(get_flavor("tiny"), n_layers=LAYERS))
    apply_ac(model, ActivationCheckpoint(mode=mode))  # type: ignore[arg-type]
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


def train(mode: str, offload: bool, micro_steps: int = 2, schedule: str = "late") -> dict[str, Any]:
    """``micro_steps`` forward + backward passes (gradients accumulate), each in its own offload context over one
    pool, as training runs them, the streams modelled under ``schedule``; what was packed per micro-step, the
    streams and the pool."""
    model = tiny(mode)
    streams = ModelStreams(SCHEDULES[schedule])
    pool = PinnedPool(streams.pin, streams.unpin)
    packed: list[list[tuple[bool, Any]]] = []
    registrations: list[int] = []
    for micro in range(micro_steps):
        tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(micro))
        hooks = StreamOffload(CPU, pool, blocks_of([model]), streams=streams)
        step: list[tuple[bool, Any]] = []  # (a weight?, what pack returned): the tensor itself is not held
        hooks.pack_hook = recording(hooks.pack, step)  # type: ignore[attr-defined]
        with hooks if offload else torch.enable_grad():
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten(0, 1))
            loss.backward()
        packed.append(step)
        registrations.append(pool.registrations)
    streams.finish()
    grads = [p.grad for p in model.parameters()]
    return dict(loss=loss.detach(), grads=grads, packed=packed, streams=streams, pool=pool, reg=registrations)


def recording(pack: Any, into: list[tuple[bool, Any]]) -> Any:
    def run(tensor: torch.Tensor) -> Any:
        into.append((is_weight(tensor), pack(tensor)))
        return into[-1][1]

    return run


def offloaded(step: list[tuple[bool, Any]]) -> list[Saved]:
    return [p for _, p in step if isinstance(p, Saved)]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_the_stream_order_gives_the_gradients_of_a_run_without_offload(mode: str, schedule: str) -> None:
    want, got = train(mode, offload=False), train(mode, offload=True, schedule=schedule)
    assert offloaded(got["packed"][0]), "nothing went through the side stream"
    assert torch.equal(got["loss"], want["loss"])
    assert all(torch.equal(g, w) for g, w in zip(got["grads"], want["grads"], strict=True))


def test_the_pool_holds_one_micro_step_exactly_and_reuses_it() -> None:
    """Not torch's power-of-two rounding nor a buffer per step: after the first micro-step one slab of exactly the
    aligned saved bytes, page-locked once and reused by the second (no new registration)."""
    out = train("none", offload=True)
    pool = out["pool"]
    nbytes = [s.host.numel() * s.host.element_size() for s in offloaded(out["packed"][0])]
    sizes = [aligned(n) for n in nbytes]
    assert len(pool.slabs) == 1 and pool.pinned_bytes == sum(sizes), (pool.pinned_bytes, sum(sizes))
    assert sum(sizes) < sum(nbytes) + len(sizes) * ALIGN  # each buffer its own size, aligned
    first, second = out["reg"]
    assert second == first, out["reg"]  # the second micro-step took its buffers from the same slab
    assert out["streams"].unpinned == first - 1  # the first micro-step's growth slabs, replaced by one


def test_weights_are_never_offloaded() -> None:
    """Every matmul saves its weight (transposed): each comes back as itself; every offloaded tensor is an
    activation. (Without the weight rule the pool would also hold every block's weights each micro-step.)"""
    for step in train("none", offload=True, micro_steps=1)["packed"]:
        weights = [p for weight, p in step if weight]
        assert len(weights) >= 7 * LAYERS and all(isinstance(p, torch.Tensor) for p in weights)  # q k v o w1 w2 w3
        assert all(isinstance(p, Saved) for weight, p in step if not weight)


def test_backward_copies_the_next_block_back_ahead_on_the_prefetch_stream() -> None:
    """The blocks before the last one come back on the prefetch stream (started when backward reaches the block after
    them); only what backward reaches first (the last block, the norm, the head) is copied back when needed."""
    out = train("none", offload=True, micro_steps=1)
    saved = offloaded(out["packed"][0])
    last = max(s.block for s in saved)
    assert sorted({s.block for s in saved}) == list(range(LAYERS + 1))  # the embedding's group, then each block
    want = {"prefetch": sum(s.block < last for s in saved), "compute": sum(s.block == last for s in saved)}
    assert copies(out["streams"].log, "copy_back") == want
    assert copies(out["streams"].log, "copy_out") == {"stream0": len(saved)}  # the side stream


def test_a_write_after_pack_cannot_race_the_copy_out() -> None:
    """On a GPU the copy out may run after a later write on the compute stream (the model runs it that late): the
    gradient would silently use the written value. The version recorded at pack turns it into an error."""
    streams = ModelStreams()
    x = torch.arange(4.0).mul(1)
    w = torch.ones(4, requires_grad=True)
    hooks = StreamOffload(CPU, PinnedPool(streams.pin, streams.unpin), streams=streams)
    with pytest.raises(RuntimeError, match="modified by an in-place operation after the forward saved it"), hooks:
        y = (x * w).sum()  # saves x for w's gradient; its copy out is queued
        x.add_(10.0)  # the compute stream writes before the side stream copied
        y.backward()
    assert x.tolist() == [10.0, 11.0, 12.0, 13.0]


def test_the_model_catches_a_missing_record_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model is not vacuous: without ``record_stream`` the late copy out finds its tensor freed."""
    monkeypatch.setattr(ModelStreams, "record_stream", lambda self, tensor, stream: None)
    with pytest.raises(UseAfterFree):
        train("none", offload=True, micro_steps=1)


def test_unpacking_after_the_context_ended_is_refused() -> None:
    """The pool's buffers serve the next micro-step once the context ends: a backward outside it would read them."""
    streams = ModelStreams()
    w = torch.ones(4, requires_grad=True)
    with StreamOffload(CPU, PinnedPool(streams.pin, streams.unpin), streams=streams):
        y = (torch.arange(4.0).mul(1) * w).sum()
    with pytest.raises(RuntimeError, match="unpacked after its context ended"):
        y.backward()


def test_a_dense_view_comes_back_with_its_strides() -> None:
    """A transposed activation keeps its strides through the pinned pool (issue 43: a contiguous copy sent backward's
    matmul to other kernels, and Float8 amplified their last bits); a view with gaps comes back contiguous."""
    streams = ModelStreams(SCHEDULES["late"])
    pool = PinnedPool(streams.pin, streams.unpin)
    hooks = StreamOffload(CPU, pool, [], streams=streams)
    with hooks:
        base = torch.randn(6, 8, requires_grad=True) * 1.0  # an activation, not a weight
        dense = [base.t(), base, base.unsqueeze(0).permute(2, 0, 1)]
        for saved in (*dense, base[:, ::2]):
            back = hooks.unpack(hooks.pack(saved))
            assert torch.equal(back, saved)
            assert back.stride() == (saved.stride() if any(saved is d for d in dense) else saved.contiguous().stride())
    streams.finish()
