"""gradient_sync once_per_step (and regather keep) under FSDP2 CPU offload on a CUDA device, where the offload is real:
the sharded parameters and gradients live on the host, the micro-steps before the last keep their unsharded
gradients on the device and the last one reduce-scatters their sum and copies it to the host
(parallel/gradient_sync.py ``set_micro_step``). On a CPU (tests/distributed/test_gradient_sync_composability.py) the
host and the device are one. One rank (NCCL, in the test's process), a small MLP: two optimizer steps of two
micro-steps each, the gradients equal a plain module's on the same GPU. Marked ``gpu``: skipped where torch has no
CUDA device (every CPU machine, CI)."""

from __future__ import annotations

import pytest
import torch
from launcher import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the offload is a no-op on a CPU)"),
]


def offloaded_accumulation(keep: bool) -> list[float]:
    """Per step, the largest relative gradient difference of the offloaded FSDP module from the
    plain one; asserts the offloaded gradients are on the host."""
    import copy

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from meshforge.parallel.gradient_sync import set_micro_step

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0)
    plain = nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(256, 256), nn.GELU()))).cuda()
    model = copy.deepcopy(plain)
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, model)]
    worst = []
    for _ in range(2):
        for micro in range(2):
            set_micro_step([model], last=micro == 1, keep=keep)
            x = torch.randn(16, 256, device="cuda")
            for m in (plain, model):
                (m(x).square().mean() / 2).backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr]
        assert all(g.device.type == "cpu" for g in grads), [g.device for g in grads]
        pairs = zip(grads, (p.grad.cpu() for p in plain.parameters()), strict=True)  # type: ignore[union-attr]
        worst.append(max(float((g - w).abs().max() / w.abs().max()) for g, w in pairs))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return worst


@pytest.mark.parametrize("keep", [False, True], ids=["reshard", "keep"])
def test_once_per_step_with_real_cpu_offload_matches_a_plain_module(
    keep: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In this process (CUDA cannot be re-initialized in a forked rank): a process group of one."""
    import torch.distributed as dist

    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        worst = offloaded_accumulation(keep)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert all(w <= 1e-5 for w in worst), worst
