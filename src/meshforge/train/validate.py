"""Validation: every ``validation.freq`` steps, the loss over a fixed set of held-out batches, under no_grad.

The validation loader reads the val split of a prepared dataset in order (no shuffle) and is rewound before each
evaluation, so every evaluation sees the same batches; its data-parallel slicing is the training loader's, so any
layout evaluates the same global batches. Each rank's forward follows the training step (context-parallel slice,
loss parallel, the pipeline schedule's ``eval``); the result is the token-weighted mean over data-parallel (and
context-parallel) ranks, and ``val_ppl = exp(val_loss)``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshforge.data.loader import PackedDataLoader, build_dataloader
from meshforge.device.precision import autocast_context
from meshforge.errors import ConfigError
from meshforge.model.loss import cross_entropy, loss_parallel_context
from meshforge.parallel.context_parallel import resolve_cp_impl, shard_batch
from meshforge.parallel.dims import sub_mesh

if TYPE_CHECKING:
    from meshforge.config.schema import JobConfig
    from meshforge.parallel.dims import ParallelDims
    from meshforge.train.loop import TrainState


def build_validation_loader(cfg: JobConfig, dims: ParallelDims, rank: int, fingerprint: str) -> PackedDataLoader | None:
    """The validation loader of this rank, or None when validation is off. ValueError for a batch the pipeline
    schedule cannot run."""
    val = cfg.validation
    if not val.enable:
        return None
    batch = cfg.training.local_batch_size if val.local_batch_size == -1 else val.local_batch_size
    if dims.pp > 1 and batch != cfg.training.local_batch_size:
        raise ConfigError(
            f"validation.local_batch_size = {batch} under pipeline parallel must equal training.local_batch_size = "
            f"{cfg.training.local_batch_size} (the schedule's microbatches are fixed): set it to -1"
        )
    training = cfg.training
    if val.dataset:
        training = dataclasses.replace(training, dataset=val.dataset, dataset_path=val.dataset_path, dataset_mixture=[])
    return build_dataloader(
        training,
        cfg.model.tokenizer_path,
        fingerprint,
        dp_rank=dims.dp_rank(rank),
        dp_degree=dims.dp,
        split="val",
        local_batch_size=batch,
        data=cfg.data,
    )


def should_validate(step: int, cfg: JobConfig) -> bool:
    """Whether validation runs after this step."""
    return cfg.validation.enable and (step % cfg.validation.freq == 0 or step == cfg.training.steps)


def batch_loss(state: TrainState, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None) -> float:
    """Mean loss of this rank's share of one batch (forward only), as the training step computes it."""
    par = state.cfg.parallelism
    cp_impl = resolve_cp_impl(par.context_parallel_impl, state.ctx.device.type)
    inputs, labels, cp_positions = shard_batch(sub_mesh(state.mesh, "cp"), cp_impl, inputs, labels)
    positions = cp_positions if positions is None else positions
    dtype, fsdp = state.cfg.training.mixed_precision_param, state.dims.fsdp_enabled
    autocast = autocast_context(dtype, state.ctx.device, fsdp_enabled=fsdp)
    with loss_parallel_context(state.dims.tp > 1 and not par.disable_loss_parallel), autocast:
        if state.pipeline is not None:
            return float(state.pipeline.evaluate(inputs, labels, positions))
        loss = cross_entropy(state.model_parts[0](inputs, positions), labels)
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    return float(loss)


@torch.no_grad()
def validate(state: TrainState, loader: PackedDataLoader) -> dict[str, float]:
    """val_loss (token-weighted mean over the data-parallel ranks) and val_ppl over validation.steps batches."""
    start = time.perf_counter()
    loader.reset()
    total, tokens = 0.0, 0
    for _ in range(state.cfg.validation.steps):
        inputs, labels = loader.next_batch()
        positions = loader.positions().to(state.ctx.device) if loader.with_positions else None
        inputs, labels = inputs.to(state.ctx.device), labels.to(state.ctx.device)
        count = labels.numel() // max(1, state.dims.cp)  # tokens this rank scores (its context-parallel slice)
        total += batch_loss(state, inputs, labels, positions) * count
        tokens += count
    sums = torch.tensor([total, float(tokens)], dtype=torch.float64)
    group_mesh = sub_mesh(state.mesh, "dp_cp")
    if group_mesh is not None:
        sums = sums.to(state.ctx.device)
        dist.all_reduce(sums, group=group_mesh.get_group())
    loss = float(sums[0] / sums[1])
    seconds = time.perf_counter() - start
    state.metrics.exclude(seconds)  # the step's time and throughput stay the training step's
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_time_s": seconds}
