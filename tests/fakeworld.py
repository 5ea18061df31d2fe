"""The real parallelization of a config, in one process: rank ``rank`` of a fake ``world``-rank process group (no
communication), the model on the meta device, as ``meshforge train --dry-run`` builds it (tools/dry_run.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshforge.config.io import load_config
from meshforge.model.hf_config import resolve_model_args
from meshforge.parallel.dims import ParallelDims
from meshforge.parallel.distributed import clear_dtensor_caches
from meshforge.tools.dry_run import build_parts

BASE = ["--model.flavor", "tiny", "--training.device", "cpu", "--training.mixed_precision_param", "float32"]


@contextlib.contextmanager
def fake_rank(rank: int, world: int) -> Iterator[None]:
    """Rank ``rank`` of a fake process group for the duration (destroyed, DTensor caches cleared after)."""
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


@contextlib.contextmanager
def parallelized(overrides: list[str], world: int, rank: int = 0) -> Iterator[dict[int, list[nn.Module]]]:
    """pipeline rank -> its parallelized stage modules (meta device) of BASE + ``overrides`` on ``world`` ranks."""
    cfg = load_config(None, [*BASE, *overrides])
    dims = ParallelDims.from_config(cfg.parallelism, world)
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    with fake_rank(rank, world):
        parts, _ = build_parts(cfg, dims, dims.build_mesh("cpu"), args)
        yield {p: [module for _, _, module in stages] for p, stages in parts.items()}
