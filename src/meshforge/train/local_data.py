"""The data of every rank simulated in this process (``meshforge train --local-ranks N``, parallel/local_ranks.py):
one loader reads the global batch and each simulated rank gets its data-parallel rows."""

from __future__ import annotations

from typing import Any, cast

import torch

from meshforge.config.schema import JobConfig
from meshforge.data.loader import PackedDataLoader, build_dataloader
from meshforge.parallel.dims import ParallelDims


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
    return cast("PackedDataLoader", LocalBatches(loader, [dims.dp_rank(r) for r in range(world_size)]))
