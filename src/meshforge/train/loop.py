"""The training loop: config -> mesh -> model -> parallelize -> steps -> metrics. One screen per function."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshforge.config import JobConfig
from meshforge.config_io import to_toml
from meshforge.model.flavors import ModelArgs, flops_per_token, get_flavor
from meshforge.model.llama import build_model
from meshforge.parallel.dims import ParallelDims, sub_mesh
from meshforge.parallel.fsdp import DTYPES
from meshforge.parallel.parallelize import parallelize
from meshforge.train.data import PackedDataLoader, build_dataloader
from meshforge.train.distributed import DistContext, init_distributed, set_timeouts
from meshforge.train.metrics import MetricsLogger, device_peak_flops, logging_ranks
from meshforge.train.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from meshforge.train.tokenizer import build_tokenizer


@dataclass
class TrainState:
    cfg: JobConfig
    ctx: DistContext
    dims: ParallelDims
    mesh: DeviceMesh | None
    model_args: ModelArgs
    model_parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loader: PackedDataLoader
    metrics: MetricsLogger
    step: int = 0


def model_args_for(cfg: JobConfig, vocab_size: int) -> ModelArgs:
    args = get_flavor(cfg.model.flavor).with_seq_len(cfg.training.seq_len)
    if vocab_size > args.vocab_size:
        raise ValueError(
            f"the tokenizer {cfg.model.tokenizer_path} has {vocab_size} tokens but model.flavor = {cfg.model.flavor} "
            f"has vocab {args.vocab_size}; use a matching tokenizer or flavor"
        )
    return args


def setup(cfg: JobConfig) -> TrainState:
    """Everything a run needs, built in the one direction data flows."""
    ctx = init_distributed(cfg.training.device, cfg.comm.init_timeout_seconds)
    if cfg.training.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.training.seed)
    dims = ParallelDims.from_config(cfg.parallelism, ctx.world_size)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    model_args = model_args_for(cfg, tokenizer.vocab_size)
    dims.validate_model(model_args, cfg.training.seq_len)
    mesh = dims.build_mesh(ctx.device.type)
    loader = build_dataloader(cfg.training, tokenizer, dp_rank=dims.dp_rank(ctx.rank), dp_degree=dims.dp)

    model = build_model(model_args)
    parallelize(
        model,
        dims,
        mesh,
        parallelism=cfg.parallelism,
        training=cfg.training,
        ac=cfg.activation_checkpoint,
        compile_cfg=cfg.compile,
        float8=cfg.quantize.dense.float8,
    )
    model.to_empty(device=ctx.device)
    model.init_weights(cfg.training.seed)  # type: ignore[operator]
    model.train()
    model_parts: list[nn.Module] = [model]

    optimizer = build_optimizer(model_parts, cfg.optimizer)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    metrics = build_metrics(cfg, ctx, dims, model_args)
    return TrainState(cfg, ctx, dims, mesh, model_args, model_parts, optimizer, scheduler, loader, metrics)


def build_metrics(cfg: JobConfig, ctx: DistContext, dims: ParallelDims, args: ModelArgs) -> MetricsLogger:
    float8 = cfg.quantize.dense.float8.enable
    peak, source = device_peak_flops(ctx.device, DTYPES[cfg.training.mixed_precision_param])
    return MetricsLogger(
        dump_folder=cfg.job.dump_folder,
        rank=ctx.rank,
        console=ctx.rank in logging_ranks(cfg.job.log_rank, ctx.world_size),
        flops_per_token=flops_per_token(args, cfg.training.seq_len),
        peak_flops=None if float8 else peak,
        peak_source=source,
        non_dp_size=dims.non_data_parallel_size,
        device=ctx.device,
        tensorboard=cfg.metrics.enable_tensorboard,
    )


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in float32: logits (batch, seq, vocab), labels (batch, seq)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def autocast_context(state: TrainState) -> contextlib.AbstractContextManager[Any]:
    """Without FSDP nobody casts parameters: use autocast for bf16/fp16 runs."""
    dtype = state.cfg.training.mixed_precision_param
    if state.dims.fsdp_enabled or dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(state.ctx.device.type, dtype=DTYPES[dtype])


def forward_backward(state: TrainState, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    """One micro-step: forward, loss, backward; returns the unscaled local loss (detached)."""
    model = state.model_parts[0]
    with autocast_context(state):
        loss = cross_entropy(model(inputs), labels)
    (loss * scale).backward()
    return loss.detach()


def train_step(state: TrainState) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over gradient_accumulation_steps micro-steps; returns (mean local loss, grad norm)."""
    accum = state.cfg.training.gradient_accumulation_steps
    state.optimizer.zero_grad(set_to_none=True)
    losses = []
    for _ in range(accum):
        start = time.perf_counter()
        inputs, labels = state.loader.next_batch()
        inputs, labels = inputs.to(state.ctx.device), labels.to(state.ctx.device)
        state.metrics.add_tokens(inputs.numel(), time.perf_counter() - start)
        losses.append(forward_backward(state, inputs, labels, 1.0 / accum))
    params = [p for part in state.model_parts for p in part.parameters()]
    grad_norm = clip_grad_norm_(params, state.cfg.training.max_norm, sub_mesh(state.mesh, "pp"))
    state.optimizer.step()
    state.scheduler.step()
    return torch.stack(losses).mean(), grad_norm


def global_mean(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Average a per-rank scalar over the data-parallel (and context-parallel) ranks."""
    group_mesh = sub_mesh(mesh, "dp_cp")
    if group_mesh is None:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG, group=group_mesh.get_group())
    return value


def should_log(step: int, cfg: JobConfig) -> bool:
    return step == 1 or step % cfg.metrics.log_freq == 0 or step == cfg.training.steps


def run_steps(state: TrainState) -> Iterator[dict[str, Any]]:
    """Train until training.steps; yields each logged record."""
    cfg = state.cfg
    while state.step < cfg.training.steps:
        state.step += 1
        loss, grad_norm = train_step(state)
        if state.step == 1:
            set_timeouts(state.mesh, cfg.comm.train_timeout_seconds)
        if should_log(state.step, cfg):
            lr = float(state.scheduler.get_last_lr()[0])
            yield state.metrics.log(state.step, global_mean(loss, state.mesh), grad_norm, lr)


def write_run_config(cfg: JobConfig, rank: int) -> None:
    if rank == 0:
        folder = Path(cfg.job.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.toml").write_text(to_toml(cfg))


def train(cfg: JobConfig) -> list[dict[str, Any]]:
    """Run the job; returns the logged records (the same as metrics.jsonl)."""
    state = setup(cfg)
    write_run_config(cfg, state.ctx.rank)
    if state.metrics.console:
        print(
            f"meshforge: {cfg.model.flavor} on {state.ctx.world_size} x {state.ctx.device.type} "
            f"({state.ctx.backend or 'single process'}), layout {state.dims}, peak FLOP/s "
            f"{state.metrics.peak_flops or 0:.3g} ({state.metrics.peak_source})",
            flush=True,
        )
    records = list(run_steps(state))
    state.metrics.close()
    return records
