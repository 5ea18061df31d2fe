"""Several ranks in one process (``parallelism.local_ranks`` / ``meshforge train --local-ranks N``), with torch's
local-tensor mode (``torch.distributed._local_tensor``): every tensor holds one real value per simulated rank, every
collective is computed from those values in this process, and no process-group traffic exists (the default group is
torch's ``fake`` backend, which only names the world). The step runs the layout's real sharded kernels once per rank,
so a layout's numerics are checked against one process without launching ranks. What runs and where it stops:
docs/parallelism.md ("Several ranks in one process")."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist

from meshforge.config.schema import JobConfig
from meshforge.data.loader import PackedDataLoader
from meshforge.errors import ConfigError
from meshforge.parallel.degrees import Degrees, degrees_from_config
from meshforge.parallel.dims import ParallelDims


def refusal(cfg: JobConfig, dims: Degrees) -> str:
    """Why this job cannot run under local ranks ('' when it can): the features torch's local-tensor mode does not
    carry in torch 2.13, each with the reason."""
    checks = [
        (
            dims.pp > 1,
            "pipeline parallel sends activations stage to stage with point-to-point ops, which local tensors carry "
            "only in LocalRunnerMode's one-thread-per-rank runner, not in one SPMD program",
        ),
        (
            dims.cp > 1,
            "context parallel's attention picks its key/value blocks by the cp rank in Python (a different slice per "
            "rank), and torch 2.13 cannot slice a tensor by a per-rank index",
        ),
        (cfg.compile.enable, "torch.compile does not trace local tensors (set compile.enable = false)"),
        (cfg.quantize.dense.float8.enable, "Float8's tensor subclass does not nest inside local tensors"),
        (cfg.training.enable_cpu_offload, "CPU offload moves FSDP2's shards by storage, which local tensors lack"),
        (
            cfg.checkpoint.enable or bool(cfg.checkpoint.initial_load_path) or cfg.checkpoint.create_seed_checkpoint,
            "a distributed checkpoint writes one file per process rank; local ranks have one process",
        ),
        (cfg.fault_tolerance.enable, "fault tolerance's replica groups are separate processes"),
        (cfg.validation.enable, "validation is not wired for local ranks (set validation.enable = false)"),
    ]
    return next((why for refused, why in checks if refused), "")


@contextlib.contextmanager
def local_world(cfg: JobConfig) -> Iterator[None]:
    """The job's ``parallelism.local_ranks`` ranks simulated in this process: a ``fake`` default process group (rank
    0 of N, no traffic) under torch's LocalTensorMode, both torn down on exit with DTensor's caches of the meshes.
    ConfigError (one line) first when the layout does not fit N ranks or uses what local tensors cannot run."""
    from torch.distributed._local_tensor import LocalTensorMode

    from meshforge.parallel.distributed import clear_dtensor_caches

    ranks = cfg.parallelism.local_ranks
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"--local-ranks {ranks} runs every rank in one process: start it without torchrun or --nproc")
    dims = degrees_from_config(cfg.parallelism, ranks)  # ConfigError when the degrees do not multiply to N
    if why := refusal(cfg, dims):
        raise ConfigError(f"--local-ranks {ranks}: {why}; run this layout with --nproc {ranks} instead")
    dist.init_process_group("fake", rank=0, world_size=ranks)
    try:
        with LocalTensorMode(ranks), fsdp_storage_per_rank():
            yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


def rank_zero(tensor: torch.Tensor) -> torch.Tensor:
    """Simulated rank 0's value of a local tensor (what rank 0's process would hold: this process is rank 0); any
    other tensor as it is."""
    from torch.distributed._local_tensor import LocalTensor

    return tensor._local_tensors[0] if isinstance(tensor, LocalTensor) else tensor


def _per_rank_storage(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``tensor``: each simulated rank's for a local tensor (which has none of its own)."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(tensor, LocalTensor):
        return [t.untyped_storage() for t in tensor._local_tensors.values()]
    return [tensor.untyped_storage()]


def alloc_storage(tensor: torch.Tensor) -> None:
    """FSDP2's ``alloc_storage``, on every simulated rank's storage."""
    size = tensor.numel() * tensor.itemsize
    for storage in _per_rank_storage(tensor):
        if storage.size() != size:
            storage.resize_(size)


def free_storage(tensor: torch.Tensor) -> None:
    """FSDP2's ``free_storage``, on every simulated rank's storage."""
    for storage in _per_rank_storage(tensor):
        if storage.size() != 0:
            storage.resize_(0)


@contextlib.contextmanager
def fsdp_storage_per_rank() -> Iterator[None]:
    """FSDP2 frees a gathered parameter after use and re-allocates it before the next all-gather by resizing its
    storage (``untyped_storage().resize_``); a local tensor is a wrapper with no storage of its own, so torch 2.13
    raises "Attempted to call resize_() on an invalid python storage". Inside this context FSDP2's two helpers resize
    each simulated rank's storage instead: the same memory life cycle, rank by rank."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    saved = _fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage
    _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc_storage, free_storage
    _fsdp_param_group.alloc_storage = alloc_storage
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage = saved


class LocalBatches:
    """The data loader of every simulated rank at once: one loader reads the global batch (the same samples, in the
    same order, as the data-parallel ranks' loaders together: data/loader.py) and each rank gets its rows, so
    ``next_batch`` returns local tensors whose rank r value is what rank r would read."""

    def __init__(self, loader: PackedDataLoader, dp_rank_of: list[int]) -> None:
        self.loader, self.dp_rank_of = loader, dp_rank_of
        self.rows = loader.local_batch_size // (max(dp_rank_of) + 1)  # each data-parallel rank's batch

    def _per_rank(self, batch: torch.Tensor) -> torch.Tensor:
        from torch.distributed._local_tensor import rank_map

        rows = self.rows
        return rank_map(lambda r: batch[self.dp_rank_of[r] * rows : (self.dp_rank_of[r] + 1) * rows].clone())

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = self.loader.next_batch()
        return self._per_rank(inputs), self._per_rank(labels)

    def positions(self) -> torch.Tensor:
        return self._per_rank(self.loader.positions())

    def __getattr__(self, name: str) -> Any:  # state_dict, global_position, ...: the global loader's
        return getattr(self.loader, name)


def build_local_loader(cfg: JobConfig, dims: ParallelDims, world_size: int, fingerprint: str) -> PackedDataLoader:
    """LocalBatches over one loader of the global batch (dp x training.local_batch_size sequences), typed as the
    loader it stands for."""
    from meshforge.data.loader import build_dataloader

    batch = dims.dp * cfg.training.local_batch_size
    loader = build_dataloader(
        cfg.training,
        cfg.model.tokenizer_path,
        fingerprint,
        dp_rank=0,
        dp_degree=1,
        local_batch_size=batch,
        data=cfg.data,
    )
    return cast(PackedDataLoader, LocalBatches(loader, [dims.dp_rank(r) for r in range(world_size)]))
