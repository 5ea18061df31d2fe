"""The training loop: config -> mesh -> model -> parallelize -> steps -> metrics. One screen per function."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshforge.config.io import check_writable
from meshforge.config.io import write_run_config as write_config_file
from meshforge.config.schema import JobConfig
from meshforge.data.loader import PackedDataLoader, build_dataloader
from meshforge.data.tokenizer import build_tokenizer
from meshforge.device.collectives import to_collective_device
from meshforge.device.determinism import enable_determinism
from meshforge.device.dtypes import DTYPES
from meshforge.device.peak import device_peak_flops
from meshforge.device.precision import autocast_context as autocast
from meshforge.device.precision import resolve_param_dtype
from meshforge.device.transfer import to_device
from meshforge.model.flavors import ModelArgs, causal_flops_per_token, flops_per_token
from meshforge.model.hf_config import model_args_for
from meshforge.model.llama import build_model
from meshforge.model.loss import cross_entropy, loss_parallel_context
from meshforge.observability.hang import HangGuard, enable_flight_recorder
from meshforge.observability.logs import launcher_rank, rank_logging
from meshforge.observability.metrics import MetricsLogger, log_step, logging_ranks
from meshforge.observability.profiling import StepProfiler, check_window, profiling
from meshforge.observability.straggler import StragglerDetector
from meshforge.parallel.activation_offload import offload_context
from meshforge.parallel.composability import job_features
from meshforge.parallel.context_parallel import resolve_cp_impl, shard_batch
from meshforge.parallel.cpu_offload import banner, materialize
from meshforge.parallel.dims import ParallelDims, sub_mesh
from meshforge.parallel.distributed import LOCAL_BACKEND, DistContext, init_distributed, set_timeouts
from meshforge.parallel.float8 import fsdp_float8_all_gather, precompute_float8_scales, resolve_emulation
from meshforge.parallel.gradient_sync import keep_gathered, set_micro_step
from meshforge.parallel.layout import Layout
from meshforge.parallel.parallelize import parallelize_job
from meshforge.train.divergence import NonFiniteGuard, TrainingDiverged
from meshforge.train.elastic import SaveClock, global_batch, keep_global_batch, saved_global_batch
from meshforge.train.fault_tolerance import FaultTolerance, data_shard
from meshforge.train.fault_tolerance import build as build_fault_tolerance
from meshforge.train.grad_accum import settle, step_once
from meshforge.train.local_data import build_local_loader as local_loader
from meshforge.train.moe_balance import balance_experts
from meshforge.train.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, step_unless
from meshforge.train.validate import build_validation_loader, should_validate, validate

if TYPE_CHECKING:  # imported where used: pipelining pulls in dynamo (~1 s), DCP ~0.3 s; most runs need neither
    from torch.distributed.checkpoint.stateful import Stateful

    from meshforge.checkpoint.dcp import Checkpointer
    from meshforge.parallel.pipeline.stage import Pipeline


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
    pipeline: Pipeline | None = None
    checkpointer: Checkpointer | None = None
    step: int = 0
    precision: str = ""  # how training.mixed_precision_param was chosen (the banner says it)
    val_loader: PackedDataLoader | None = None
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)
    moe_metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # device values, read on log steps
    straggler: StragglerDetector = field(default_factory=lambda: StragglerDetector(0.0, console=False))
    save_clock: SaveClock = field(default_factory=lambda: SaveClock(0.0))
    ft: FaultTolerance | None = None  # torchft replica groups (train/fault_tolerance.py)
    regather_keep: bool = (
        False  # gradient_sync.regather auto: decided after the first step run once per step, again while kept
    )
    sync_once: bool | None = None  # gradient_sync.mode auto, decided after the first step (train/grad_accum.py)


def setup(cfg: JobConfig) -> TrainState:
    """Everything a run needs, built in the one direction data flows."""
    check_writable(Path(cfg.job.dump_folder), "job.dump_folder")
    ctx = init_distributed(cfg.training.device, cfg.comm.init_timeout_seconds, cfg.training.enable_cpu_offload)
    cfg, precision = with_param_dtype(cfg, ctx.device)
    if cfg.training.deterministic:
        enable_determinism(ctx.device)
    torch.manual_seed(cfg.training.seed)
    dims = ParallelDims.from_config(cfg.parallelism, ctx.world_size)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    model_args = model_args_for(cfg, tokenizer.vocab_size)
    Layout.from_config(cfg, ctx.world_size).check(model_args)  # the one rule set (parallel/layout.py)
    dims.validate_features(
        cfg.parallelism,
        device=ctx.device,
        compile_enabled=cfg.compile.enable,
        float8=cfg.quantize.dense.float8,
        features=job_features(cfg, model_args),
    )
    mesh = dims.build_mesh(ctx.device.type)
    dp_rank, dp_degree = data_shard(cfg, dims.dp_rank(ctx.rank), dims.dp)  # replica groups read their own slots
    if ctx.backend == LOCAL_BACKEND:  # every simulated rank's rows of one global batch (train/local_data.py)
        loader = local_loader(cfg, dims, ctx.world_size, tokenizer.fingerprint)
    else:
        loader = build_dataloader(
            cfg.training,
            cfg.model.tokenizer_path,
            tokenizer.fingerprint,
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            data=cfg.data,
        )

    model_parts, pipeline = build_model_parts(cfg, ctx, dims, mesh, model_args)
    optimizer = build_optimizer(model_parts, cfg.optimizer)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    metrics = build_metrics(cfg, ctx, dims, model_args)
    state = TrainState(cfg, ctx, dims, mesh, model_args, model_parts, optimizer, scheduler, loader, metrics, pipeline)
    state.precision = precision
    state.val_loader = build_validation_loader(cfg, dims, ctx.rank, tokenizer.fingerprint)
    state.guard = NonFiniteGuard(cfg.training.skip_nonfinite_steps, console=metrics.console)
    state.checkpointer = build_checkpointer(cfg, ctx, dims, metrics.console)
    if state.checkpointer is not None:  # resume (or load initial weights) now that optimizer and scheduler exist
        state.step = state.checkpointer.load(checkpoint_states(state))
        if state.step > 0:  # elastic resume: the saved global batch by gradient accumulation (train/elastic.py)
            state.cfg = keep_global_batch(state.cfg, dims, saved_global_batch(cfg, state.step), metrics.console)
    state.straggler = StragglerDetector(cfg.metrics.straggler_threshold, console=metrics.console)
    state.save_clock = SaveClock(cfg.checkpoint.interval_seconds)
    state.ft = build_fault_tolerance(state.cfg, state)
    return state


def with_param_dtype(cfg: JobConfig, device: torch.device) -> tuple[JobConfig, str]:
    """The config with ``training.mixed_precision_param = auto`` (device/precision.py) and Float8's ``emulate = auto``
    resolved for ``device``, and a sentence for the banner. On a CPU rank 0's choice holds on every rank (each host's
    probe could differ)."""
    name, why = resolve_param_dtype(cfg.training.mixed_precision_param, device)
    if cfg.training.mixed_precision_param == "auto" and device.type == "cpu" and dist.is_initialized():
        chosen = [(name, why)]
        dist.broadcast_object_list(chosen, src=0)
        name, why = chosen[0]
    training = dataclasses.replace(cfg.training, mixed_precision_param=name)  # type: ignore[arg-type]
    float8, how = resolve_emulation(cfg.quantize.dense.float8, device)  # emulate = auto: the device decides
    quantize = dataclasses.replace(cfg.quantize, dense=dataclasses.replace(cfg.quantize.dense, float8=float8))
    return dataclasses.replace(cfg, training=training, quantize=quantize), f"{name} ({why})" + (how and f", {how}")


def checkpoint_states(state: TrainState) -> dict[str, Stateful]:
    """What a checkpoint holds, by name (checkpoint/stateful.py); the model before its optimizer."""
    from meshforge.checkpoint.stateful import ModelParts, OptimizerState, RNGState, TrainProgress

    model = ModelParts(state.model_parts, state.model_args)
    return {
        "model": model,
        "optimizer": OptimizerState(model, state.optimizer),
        "train": TrainProgress(lambda: state.step, state.scheduler, state.loader),
        "rng": RNGState(state.ctx.rank, state.ctx.device),
    }


def build_checkpointer(cfg: JobConfig, ctx: DistContext, dims: ParallelDims, console: bool) -> Checkpointer | None:
    ck = cfg.checkpoint
    if not (ck.enable or ck.initial_load_path or ck.create_seed_checkpoint):
        return None
    from meshforge.checkpoint.dcp import Checkpointer

    return Checkpointer(
        ck,
        dump_folder=cfg.job.dump_folder,
        total_steps=cfg.training.steps,
        info={"flavor": cfg.model.flavor, "layout": str(dims), "global_batch": global_batch(cfg, dims)},
        device=ctx.device,
        timeout_s=max(cfg.comm.init_timeout_seconds, cfg.comm.train_timeout_seconds),
        console=console,
    )


def build_model_parts(
    cfg: JobConfig, ctx: DistContext, dims: ParallelDims, mesh: DeviceMesh | None, model_args: ModelArgs
) -> tuple[list[nn.Module], Pipeline | None]:
    """The parallelized, initialised model, or under pipeline parallel this rank's stages and their schedule."""
    model = build_model(model_args)
    model.document_mask = cfg.training.document_mask
    model.loss_chunks = cfg.training.loss_chunks
    parallelize_part = functools.partial(parallelize_job, cfg=cfg, dims=dims, mesh=mesh)
    if dims.pp > 1:
        from meshforge.parallel.pipeline.stage import build_pipeline

        pipeline = build_pipeline(
            model,
            dims,
            mesh,
            parallelism=cfg.parallelism,
            training=cfg.training,
            compile_enabled=cfg.compile.enable,
            device=ctx.device,
            parallelize_part=parallelize_part,
            loss_fn=cross_entropy,
            ac=cfg.activation_checkpoint,
        )
        return pipeline.model_parts, pipeline
    parallelize_part(model)
    materialize(model, ctx.device, cpu_offload=cfg.training.enable_cpu_offload)
    model.init_weights(cfg.training.seed)
    model.train()
    return [model], None


def build_metrics(cfg: JobConfig, ctx: DistContext, dims: ParallelDims, args: ModelArgs) -> MetricsLogger:
    float8 = cfg.quantize.dense.float8.enable
    peak, source = device_peak_flops(ctx.device, DTYPES[cfg.training.mixed_precision_param])
    return MetricsLogger(
        dump_folder=cfg.job.dump_folder,
        rank=ctx.rank,
        # with log files every rank prints; train/logs.py keeps the console to job.log_rank
        console=ctx.rank in logging_ranks(cfg.job.log_rank, ctx.world_size) or cfg.job.log_to_files,
        flops_per_token=flops_per_token(args, cfg.training.seq_len),
        flops_per_token_causal=causal_flops_per_token(args, cfg.training.seq_len),
        peak_flops=None if float8 else peak,
        peak_source=source,
        peak_from_probe=ctx.device.type == "cpu",
        non_dp_size=dims.non_data_parallel_size,
        device=ctx.device,
        tensorboard=cfg.metrics.enable_tensorboard,
        progress_bar=cfg.metrics.progress_bar,
        wandb=cfg.metrics.enable_wandb,
    )


def autocast_context(state: TrainState) -> contextlib.AbstractContextManager[Any]:
    """Without FSDP nobody casts parameters: use autocast for bf16/fp16 runs (device/precision.py)."""
    return autocast(state.cfg.training.mixed_precision_param, state.ctx.device, fsdp_enabled=state.dims.fsdp_enabled)


def forward_backward(state: TrainState, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    """One micro-step: this rank's context-parallel slice of the batch (with global positions), forward, loss,
    backward (vocab-parallel under loss parallel); returns the unscaled local loss (detached)."""
    model, par = state.model_parts[0], state.cfg.parallelism
    cp_impl = resolve_cp_impl(par.context_parallel_impl, state.ctx.device.type)
    inputs, labels, positions = shard_batch(sub_mesh(state.mesh, "cp"), cp_impl, inputs, labels)
    if state.cfg.training.document_mask:  # in-document positions (context parallel is refused at set-up)
        positions = state.loader.positions().to(inputs.device)
    offload = offload_context(state.cfg.activation_checkpoint.offload, state.ctx.device, state.model_parts)
    with loss_parallel_context(state.dims.tp > 1 and not par.disable_loss_parallel), offload:
        if state.pipeline is not None:  # the schedule runs forward, loss and backward of every microbatch
            with autocast_context(state):
                return state.pipeline.step(inputs, labels, scale, positions)
        with autocast_context(state):
            chunked = state.cfg.training.loss_chunks > 1  # the model returns the loss (model/loss.py)
            loss = model(inputs, positions, labels) if chunked else cross_entropy(model(inputs, positions), labels)
        (loss * scale).backward()
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss  # loss parallel: a replicated DTensor


def train_step(state: TrainState) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over gradient_accumulation_steps micro-steps; returns (mean local loss, grad norm)."""
    accum = state.cfg.training.gradient_accumulation_steps
    state.optimizer.zero_grad(set_to_none=True)
    losses, data = [], 0.0
    if state.ft is not None:  # the quorum; a (re)joining group receives a live peer's state here
        state.ft.start_step()
    state.straggler.times.begin()  # the step's time parts (observability/straggler.py)
    sync_once = step_once(state)  # gradient_sync auto: decided by memory after the first step (train/grad_accum.py)
    keep = keep_gathered(state.cfg.gradient_sync) or state.regather_keep
    for micro in range(accum):
        if sync_once:  # one gradient exchange per step: the last micro-step's (parallel/gradient_sync.py)
            set_micro_step(state.model_parts, last=micro == accum - 1, keep=keep, pipeline=state.pipeline)
        start = time.perf_counter()
        inputs, labels = state.loader.next_batch()  # host tensors: the time counted as data loading ends here
        waited = time.perf_counter() - start
        state.metrics.add_tokens(inputs.numel(), waited)
        data += waited
        inputs, labels = to_device(inputs, state.ctx.device), to_device(labels, state.ctx.device)
        losses.append(forward_backward(state, inputs, labels, 1.0 / accum))
    state.straggler.times.split(data)
    params = [p for part in state.model_parts for p in part.parameters()]
    if state.ft is not None:  # the replicate dimension's all-reduce, over the live groups
        state.ft.sync_gradients(params)
    grad_norm = clip_grad_norm_(params, state.cfg.training.max_norm, sub_mesh(state.mesh, "pp"))
    loss = torch.stack(losses).mean()
    if state.model_args.is_moe:  # expert-bias update from this step's global expert loads (train/moe_balance.py)
        meshes = sub_mesh(state.mesh, "dp_cp"), sub_mesh(state.mesh, "pp")
        across = state.ft.sum_across if state.ft is not None else None  # replica groups: the global load
        state.moe_metrics = balance_experts(state.model_parts, *meshes, state.model_args.load_balance_coeff, across)
    if state.ft is not None and not state.ft.should_commit():  # a replica failed: the step is retried
        return loss, grad_norm
    # the same decision on every rank (global norm), kept on the device; read on log / save steps (guard.check)
    step_unless(state.optimizer, state.guard.skip_flag(state.step, grad_norm, loss))
    if fsdp_float8_all_gather(state.cfg.quantize.dense.float8, fsdp=state.dims.fsdp_enabled):
        precompute_float8_scales(state.model_parts)  # one all-reduce now instead of one per weight per all-gather
    state.scheduler.step()
    state.straggler.times.end()
    return loss, grad_norm


def global_mean(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Average a per-rank scalar over the data-parallel (and context-parallel) ranks."""
    group_mesh = sub_mesh(mesh, "dp_cp")
    if group_mesh is None:
        return value
    group = group_mesh.get_group()
    value = to_collective_device(value.detach(), group).clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG, group=group)
    return value


def should_log(step: int, cfg: JobConfig) -> bool:
    return log_step(step, cfg.metrics.log_freq, cfg.training.steps)


def save_due(state: TrainState, force: bool) -> bool:
    """Whether the checkpointer saves after this step (checkpoint/dcp.py ``maybe_save``'s rule)."""
    ck = state.checkpointer
    if ck is None or not ck.cfg.enable:
        return False
    return force or state.step >= ck.total_steps or state.step % ck.cfg.interval == 0


def run_steps(state: TrainState, profiler: StepProfiler | None = None) -> Iterator[dict[str, Any]]:
    """Train until training.steps; yields each logged record."""
    cfg = state.cfg
    first_step = state.step + 1  # > 1 after a resume
    states = checkpoint_states(state)
    while state.step < cfg.training.steps:
        state.step += 1
        loss, grad_norm = train_step(state)
        if state.ft is not None and state.ft.retry:
            state.step -= 1
            continue
        state.metrics.step_done(state.step, cfg.training.steps)
        if state.step == first_step:
            set_timeouts(state.mesh, cfg.comm.train_timeout_seconds)
        settle(state, first_step, logged=should_log(state.step, cfg))  # gradient_sync auto (train/grad_accum.py)
        logged: dict[str, Any] = {}
        due = 0.0  # rank 0's wall-time save decision rides on the straggler gather of log steps (train/elastic.py)
        if should_log(state.step, cfg):
            logged, due = state.straggler.observe(state.step, state.save_clock.flag())
        if should_log(state.step, cfg) or save_due(state, due > 0):  # the host reads the divergence guard here only
            state.guard.check()
        if state.checkpointer is not None:  # before the yield: a consumer that stops here still has its checkpoint
            state.checkpointer.maybe_save(states, state.step, force=due > 0)
            state.save_clock.after(state.step, cfg.checkpoint.interval, forced=due > 0)
        evaluation = validate(state, state.val_loader) if state.val_loader and should_validate(state.step, cfg) else {}
        if should_log(state.step, cfg) or evaluation:
            lr = float(state.scheduler.get_last_lr()[0])
            extra = state.pipeline.metrics() if state.pipeline is not None else {}  # bubble (collective)
            extra.update({k: float(v) for k, v in state.moe_metrics.items()})
            extra.update(logged)
            yield state.metrics.log(state.step, global_mean(loss, state.mesh), grad_norm, lr, extra | evaluation)
        if profiler is not None:  # after logging and saving: a traced step shows all of its work
            profiler.step(state.step)


def write_run_config(cfg: JobConfig, rank: int) -> None:
    if rank == 0:
        write_config_file(cfg, Path(cfg.job.dump_folder))


@contextlib.contextmanager
def observed(state: TrainState) -> Iterator[StepProfiler | None]:
    """The hang guard and the profiler around the steps (train/hang.py, train/profiling.py)."""
    cfg, ctx = state.cfg, state.ctx
    guard = HangGuard(cfg.job.dump_folder, ctx.rank, ctx.world_size, status=lambda: f"in training step {state.step}")
    first, last = state.step + 1, cfg.training.steps
    window = profiling(
        cfg.profiling,
        dump_folder=cfg.job.dump_folder,
        rank=ctx.rank,
        device=ctx.device,
        first_step=first,
        last_step=last,
    )
    with guard, window as profiler:
        yield profiler


def train(cfg: JobConfig) -> list[dict[str, Any]]:
    """Run the job; returns the logged records (the same as metrics.jsonl). Output goes to the ranks in
    job.log_rank and, with job.log_to_files, to every rank's log file (train/logs.py)."""
    check_window(cfg.profiling)
    enable_flight_recorder(cfg.job.dump_folder)  # before the process group exists
    with rank_logging(cfg.job, *launcher_rank()):
        return run_job(setup(cfg))


def run_job(state: TrainState) -> list[dict[str, Any]]:
    """The run after setup: banner, seed checkpoint or the steps (observed), clean-up."""
    cfg = state.cfg
    write_run_config(cfg, state.ctx.rank)
    if state.metrics.console:
        peak = "n/a" if state.metrics.peak_flops is None else f"{state.metrics.peak_flops:.3g}"
        print(
            f"meshforge: {cfg.model.flavor} on {state.ctx.world_size} x {state.ctx.device.type} "
            f"({state.ctx.backend or 'single process'}), layout {state.dims}, peak FLOP/s "
            f"{peak} ({state.metrics.peak_source}), compute dtype {state.precision}",
            flush=True,
        )
        if offload := banner(cfg.training.enable_cpu_offload, state.ctx.device):
            print(f"meshforge: {offload}", flush=True)
    if cfg.checkpoint.create_seed_checkpoint:
        assert state.checkpointer is not None
        # step-0: initial weights any layout can load
        state.checkpointer.save(checkpoint_states(state), state.step, model_only=True)
        state.checkpointer.close()
        return []
    state.metrics.start(state.step)
    try:
        with observed(state) as profiler:
            records = list(run_steps(state, profiler))
    except TrainingDiverged as exc:
        if state.checkpointer is not None:
            state.checkpointer.close()  # a background save of an earlier, good step still commits
            exc.args = (f"{exc.args[0]}; {state.checkpointer.last_good()}",)
        raise
    if state.checkpointer is not None:
        state.checkpointer.close()
    if state.ft is not None:
        state.ft.close()
    state.metrics.close()
    return records
