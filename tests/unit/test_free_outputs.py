"""Freeing a pipeline stage's sent output and its receive buffers (parallel/pipeline/free_outputs.py): backward stays
exact, a send in flight keeps its data, shared storages are not claimed, and the memory tracker of the exact dry run
counts what is freed as a real allocation does."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from meshforge.parallel.pipeline.free_outputs import release_buffer, release_output, restore_buffer


def stage(seed: int = 0) -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Linear(32, 32), torch.randn(8, 32, requires_grad=True)


def grads(release: bool) -> list[torch.Tensor]:
    lin, x = stage()
    out = torch.relu(lin(x)) + x  # a block: its output is the residual add's, which backward does not save
    if release:
        assert release_output(out, aliases=0) == 8 * 32 * 4
        assert out.untyped_storage().nbytes() == 4 and out.shape == (8, 32)
    out.backward(torch.full((8, 32), 0.5))
    assert lin.weight.grad is not None and x.grad is not None
    return [lin.weight.grad, lin.bias.grad, x.grad]


def total(tracker: MemTracker) -> int:
    """The tracker's bytes now (a device whose total reaches 0 leaves the snapshot)."""
    return sum(int(snapshot["Total"]) for snapshot in tracker.get_tracker_snapshot().values())


def test_backward_of_a_released_output_is_exact() -> None:
    for got, want in zip(grads(release=True), grads(release=False), strict=True):
        assert torch.equal(got, want)


def test_a_send_in_flight_keeps_the_outputs_data() -> None:
    lin, x = stage()
    out = lin(x) + x
    send = out.detach()  # what the pipeline's isend holds (torch's get_fwd_send_ops)
    want = send.clone()
    assert release_output(out, aliases=1) == 8 * 32 * 4
    kept, size = send.untyped_storage().nbytes(), want.nbytes  # ints: a freed tensor's repr would read freed memory
    assert kept == size, "the storage under a send in flight was freed"
    assert torch.equal(send, want), "the storage under a send in flight was overwritten"


def test_a_storage_something_else_shares_is_not_claimed() -> None:
    lin, x = stage()
    saved = torch.exp(lin(x))  # exp's backward saves its output: releasing it would free nothing
    assert release_output(saved, aliases=0) == 0
    base = lin(x) + x
    view = base[:4]
    assert release_output(view, aliases=0) == 0  # a view: its base keeps the storage
    assert release_output(base, aliases=0) == 0  # and the view keeps the base's


def test_a_dtensor_output_releases_its_local_shard() -> None:
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        dtensor_release(init_device_mesh("cpu", (1,)))
    finally:
        torch.distributed.destroy_process_group()  # later tests (the dry run) refuse a live process group


def dtensor_release(mesh: DeviceMesh) -> None:
    lin, x = stage()
    h = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(lin.weight.detach(), mesh, [Replicate()]).requires_grad_()
    out = h @ w + h
    assert isinstance(out, DTensor)
    assert release_output(out, aliases=0) == 8 * 32 * 4
    out.backward(torch.ones_like(out))
    assert h.grad is not None and w.grad is not None


def test_a_receive_buffer_is_freed_and_restored_and_the_tracker_counts_it() -> None:
    buffer = torch.zeros(8, 32)
    tracker = MemTracker()
    tracker.track_external(buffer)
    with tracker:
        before = total(tracker)
        assert release_buffer(buffer) == 8 * 32 * 4
        after = total(tracker)
    assert buffer.untyped_storage().nbytes() == 0 and buffer.shape == (8, 32)
    assert before - after == 8 * 32 * 4, (before, after)  # a storage resized to 0 counts 0, as on the allocator
    restore_buffer(buffer)
    buffer.fill_(1.0)
    assert buffer.untyped_storage().nbytes() == 8 * 32 * 4 and buffer.sum().item() == 8 * 32


def test_the_tracker_counts_a_released_output_as_freed() -> None:
    lin, x = stage()
    tracker = MemTracker()
    tracker.track_external(lin)
    with tracker:
        out = lin(x) + x
        held = total(tracker)
        release_output(out, aliases=0)
        freed = total(tracker)
    assert held - freed == 8 * 32 * 4 - 4  # the storage less the one-element placeholder
