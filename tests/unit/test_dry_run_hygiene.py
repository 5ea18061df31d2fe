"""A dry run leaves the process as it found it: no process group, the default dtype and device, and no DeviceMesh of
its fake world in torch's DTensor caches (a later mesh of the same shape and names, here or in a forked rank, would get
the dry run's rank-0 mesh back in cached specs: the checkpoint "invalid fill" after
tests/unit/test_hf_config.py::test_dry_run_measures_the_qwen3_extras, see
parallel/distributed.py:clear_dtensor_caches)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from fakeworld import fake_rank
from torch.distributed.tensor import DTensor

from meshforge.config.io import load_config
from meshforge.model.flavors import get_flavor
from meshforge.parallel.dims import ParallelDims
from meshforge.tools.dry_run import build_parts, plan


def test_a_dry_run_leaves_no_torch_global_state_behind() -> None:
    overrides = ["--model.flavor", "tiny", "--training.device", "cpu", "--training.mixed_precision_param", "float32"]
    cfg = load_config(None, overrides)
    before = (torch.get_default_dtype(), torch.get_default_device(), dist.is_initialized())
    plan(cfg, 2)  # rank 0 of a fake 2-rank world: FSDP 2 over the tiny model (1-D norm weights of 64)
    assert (torch.get_default_dtype(), torch.get_default_device(), dist.is_initialized()) == before
    args = get_flavor("tiny").with_seq_len(cfg.training.seq_len)
    dims = ParallelDims.from_config(cfg.parallelism, 2)
    with fake_rank(1, 2):  # now rank 1 of the same layout (its own specs are cleared after, too)
        mesh = dims.build_mesh("cpu")
        assert mesh is not None and tuple(mesh.get_coordinate() or ()) == (1,)
        parts, _ = build_parts(cfg, dims, mesh, args)
        stale = {
            name: param.device_mesh.get_coordinate()
            for _, _, part in parts[0]
            for name, param in part.named_parameters()
            if isinstance(param, DTensor) and tuple(param.device_mesh.get_coordinate() or ()) != (1,)
        }
    first = dict(list(stale.items())[:3])
    assert not stale, f"{len(stale)} parameters on rank 1 hold the dry run's rank-0 mesh (cached DTensor spec): {first}"
