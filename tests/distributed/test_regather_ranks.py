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


GIB = 2**30
CAPACITY_GIB = (80, 80, 11, 80)
"""The device's size each decision reads (injected; steps 1, 2, 3 and 4 are log steps): 10 GiB reserved (8
allocated) plus the gathered parameters fit 80 GiB (step 1: keep; step 2: still keep); at step 3 10 + the 1.5 GiB
reserve outside the allocator no longer fit 11 (the peak moved against the device): reshard from step 4."""


def _forced_keep() -> dict[str, object]:
    """2 gloo ranks, FSDP 2, gradient accumulation 4, regather auto with the device readings injected (a CPU has
    none: train/regather.py ``device_readings``): per step the all-gathers (meshforge's collective counter over the
    real train_step) and, after each micro-step, how many parameters are unsharded with their memory held."""
    import tempfile

    from parity import BASE
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from meshforge.config.io import load_config
    from meshforge.device.collective_counter import CollectiveCounter, axis_names
    from meshforge.parallel.dims import FLATTENED
    from meshforge.train import loop, regather

    reads = iter(CAPACITY_GIB)
    regather.device_readings = lambda device: regather.Readings(10 * GIB, 8 * GIB, 0, next(reads) * GIB)
    overrides = ["--training.local_batch_size", "1", "--training.gradient_accumulation_steps", "4"]
    overrides += ["--gradient_sync.mode", "once_per_step"]  # auto would run step 1 every micro-step (grad_accum.py)
    overrides += ["--training.steps", "4", "--job.dump_folder", tempfile.mkdtemp(prefix="meshforge-test-")]
    state = loop.setup(load_config(None, [*BASE, *overrides]))
    params = [p for part in state.model_parts for p in part.parameters()]
    gathered: dict[int, list[int]] = {}
    gathers: dict[int, int] = {}
    real_step, real_fb = loop.train_step, loop.forward_backward

    def held() -> int:  # FSDP2 registers the unsharded parameter (plain tensor) while gathered, else the DTensor shard
        live = [p for part in state.model_parts for p in part.parameters()]
        return sum(not isinstance(p, DTensor) and p.untyped_storage().size() > 0 for p in live)

    def micro_step(s, *args):  # type: ignore[no-untyped-def]
        out = real_fb(s, *args)
        gathered.setdefault(s.step, []).append(held())
        return out

    def counted(s):  # type: ignore[no-untyped-def]
        with CollectiveCounter(axis_names(s.mesh, FLATTENED)) as counter:
            out = real_step(s)
        gathers[s.step] = sum(v[0] for (c, _), v in counter.table().items() if c.startswith("all_gather"))
        return out

    loop.train_step, loop.forward_backward = counted, micro_step  # type: ignore[assignment]
    try:
        loop.run_job(state)
    finally:
        loop.train_step, loop.forward_backward = real_step, real_fb  # type: ignore[assignment]
    fsdp = sum(isinstance(m, FSDPModule) for part in state.model_parts for m in part.modules())
    return {"gathered": gathered, "gathers": gathers, "params": len(params), "fsdp_modules": fsdp}


def test_a_forced_keep_holds_the_parameters_gathered_between_micro_steps_until_the_peak_moves() -> None:
    """The ``keep`` path of regather auto, forced on a CPU by injecting the device's readings: from step 2 every
    parameter stays unsharded (its memory held) after each non-last micro-step, and each FSDP module saves one
    all-gather per later micro-step; once the peak no longer fits (step 3's reading) step 4 reshards again."""
    for rank, out in enumerate(run_ranks(_forced_keep, 2, timeout=180)):
        gathered, gathers, n = out["gathered"], out["gathers"], out["params"]
        assert gathered[1] == [0, 0, 0, 0], (rank, gathered)  # step 1: resharded after every backward
        for step in (2, 3):  # kept: gathered between micro-steps, resharded after the last one
            assert gathered[step] == [n, n, n, 0], (rank, step, gathered)
        assert gathered[4] == [0, 0, 0, 0], (rank, gathered)  # re-decided at step 3: reshard
        saved = 3 * out["fsdp_modules"]  # micro-steps 2-4 of a kept step skip each module's forward all-gather
        assert gathers[2] == gathers[3] == gathers[1] - saved and gathers[4] == gathers[1], (rank, gathers, saved)
