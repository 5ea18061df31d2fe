"""train/regather.py on 2 gloo ranks: the bytes ``keep`` would hold are the FSDP-gathered parameters (tensor-parallel
shards stay sharded), and the ranks agree on keep only when every rank can."""

from __future__ import annotations

import pytest
from launcher import run_ranks

pytestmark = pytest.mark.distributed


def _measure() -> tuple[int, int, int, bool, bool]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from meshforge.train import regather

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))  # 16*32 + 32 + 32*8 + 8 = 808 parameters
    fully_shard(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard_cp",)))
    fsdp = regather.gathered_bytes([model], torch.bfloat16)
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    weight = nn.Parameter(distribute_tensor(torch.zeros(64, 8), tp_mesh, [Shard(0)]))  # 512 elements, 256 a rank
    tp = regather.unsharded_numel(weight)
    both = regather.agree(rank == 0, torch.device("cpu")), regather.agree(True, torch.device("cpu"))
    return rank, fsdp, tp, *both


def test_gathered_bytes_and_the_ranks_agreement() -> None:
    for rank, fsdp, tp, one_refuses, all_can in run_ranks(_measure, 2, timeout=120):
        assert fsdp == 808 * 2, (rank, fsdp)  # the whole model, gathered, in bf16: what keep holds on each rank
        assert tp == 256, (rank, tp)  # a tensor-parallel shard stays a shard
        assert one_refuses is False and all_can is True, rank
