"""`meshforge train --dry-run --world-size N`: check a layout at full scale on this machine, without devices.

The real code runs, on meta tensors: torch's fake process group stands in for an N-rank job (rank 0; no
communication, no devices), ``ParallelDims`` builds the real N-rank DeviceMesh, the real model is built on the meta
device, and the real ``parallelize`` (Float8 -> TP -> CP -> AC -> compile -> FSDP) shards it. Under pipeline parallel
the real stage plan of parallel/pipeline.py (schedule, microbatches, module split, stage -> rank map, compatibility)
picks each pipeline rank's stages, which are cut from the model and parallelized the same way. Every check a real
run makes before its first step therefore runs here too; any ValueError is reported in one line with exit code 2.

Per-rank memory is summed from the local shards (``DTensor.to_local()``) of each pipeline rank's stages, as placed on
the rank at data-parallel, context-parallel and tensor-parallel coordinate 0 (the mesh of rank 0; other coordinates hold
the same shapes up to one row of padding per tensor). Conventions:
  * parameters: the sharded master weights in their dtype (fp32; mixed precision only casts for compute);
  * gradients: one per parameter, same local shape and dtype (FSDP2 reduce-scatters in reduce_dtype, then stores the
    sharded gradient in the parameter's dtype);
  * optimizer: Adam/AdamW's exp_avg and exp_avg_sq, each like the parameter (the per-tensor step counters are
    ignored);
  * not counted: activations, FSDP's transient all-gather buffers, communication buffers (see ``meshforge plan``).

The target is CUDA unless ``training.device = 'cpu'``; for a CUDA target the checks that need the GPU itself (Float8's
compute capability) are listed as notes, and options that change only how the target communicates, not the sharding
(async TP), are validated for it but built with their CPU equivalents.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Shard, _StridedShard

from meshforge.config.schema import JobConfig, Parallelism
from meshforge.data.tokenizer import build_tokenizer, resolve_path
from meshforge.device.precision import resolve_param_dtype
from meshforge.errors import ConfigError
from meshforge.model.flavors import ModelArgs, param_counts
from meshforge.model.hf_config import model_args_for, model_label, resolve_model_args
from meshforge.model.llama import build_model, canonical_name
from meshforge.observability.metrics import logging_ranks
from meshforge.observability.profiling import check_window
from meshforge.parallel.composability import job_features
from meshforge.parallel.dims import AXES, ParallelDims
from meshforge.parallel.distributed import clear_dtensor_caches
from meshforge.parallel.float8 import resolve_emulation
from meshforge.parallel.layout import Layout
from meshforge.parallel.parallelize import parallelize_job
from meshforge.parallel.pipeline.split import module_order, prune_to_stage
from meshforge.parallel.pipeline.stage import plan_pipeline

GIB = 2**30
OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2}


@dataclass
class PipelineRank:
    """What one pipeline rank holds (the whole model when there is no pipeline)."""

    pp_rank: int
    stages: list[tuple[int, list[str]]]  # (stage index, module names)
    param_elements: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass
class DryRun:
    flavor: str
    world_size: int
    dims: ParallelDims
    target: str
    total_params: int
    ranks: list[PipelineRank]
    axes: dict[str, str]  # mesh axis -> what it shards
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks, as rank 0, for the duration (destroyed after)."""
    if dist.is_initialized():
        raise ConfigError("--dry-run must run outside a distributed job (a process group exists); run it alone")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()  # cached DTensor specs hold this world's rank-0 meshes (parallel/distributed.py)


def target_device(requested: str) -> str:
    return "cpu" if requested == "cpu" else "cuda"


def model_args(cfg: JobConfig, notes: list[str]) -> ModelArgs:
    """The flavor at the configured sequence length; the tokenizer's vocabulary is checked when the file is here."""
    path = cfg.model.tokenizer_path
    if path.startswith("hf:"):
        notes.append(f"tokenizer {path} is on the hub: its vocabulary is not checked against the flavor here")
        return resolve_model_args(cfg.model, cfg.training.seq_len)
    try:
        resolve_path(path)
    except ConfigError:
        notes.append(f"tokenizer {path} is not on this machine: vocabulary not checked (a real run needs the file)")
        return resolve_model_args(cfg.model, cfg.training.seq_len)
    return model_args_for(cfg, build_tokenizer(path).vocab_size)


def check_features(cfg: JobConfig, dims: ParallelDims, target: str, notes: list[str], args: ModelArgs) -> None:
    """ParallelDims.validate_features for the target device (every composability column of the job); GPU-only checks
    become notes."""
    float8, how = resolve_emulation(cfg.quantize.dense.float8, torch.device(target))
    if how:
        notes.append(f"{how} on the {target} target")
    if target == "cuda" and float8.enable and not float8.emulate:
        notes.append("Float8 needs CUDA compute capability >= 8.9 on the target GPUs (not checkable without them)")
        float8 = dataclasses.replace(float8, enable=False)
    dims.validate_features(
        cfg.parallelism,
        device=torch.device(target),
        compile_enabled=cfg.compile.enable,
        float8=float8,
        features=job_features(cfg, args),
    )
    if cfg.parallelism.enable_async_tensor_parallel:
        notes.append("async TP: valid for this target; it changes only how TP communicates, so it is not applied here")


def pipeline_plan(cfg: JobConfig, dims: ParallelDims, n_layers: int) -> tuple[str, list[list[str]], dict[int, int]]:
    """The real pipeline checks and split (parallel/pipeline.py): schedule, module names per stage, stage -> rank."""
    par = cfg.parallelism
    plan = plan_pipeline(par, cfg.training, dims, n_layers, cfg.compile.enable, cfg.activation_checkpoint)
    modules = plan.modules
    summary = (
        f"{len(modules)} stages, {len(modules) // dims.pp} per rank ({plan.spec.name}), {plan.n_microbatches} "
        f"microbatches of {par.pipeline_parallel_microbatch_size}"
    )
    return summary, modules, plan.stage_rank


def meta_parallelism(par: Parallelism) -> Parallelism:
    """The options as the meta build can apply them: those that only change how a CUDA target communicates (async
    TP; validated for the target already) are swapped for their CPU equivalents, same sharding."""
    return dataclasses.replace(par, enable_async_tensor_parallel=False)


def parallelize_meta(model: nn.Module, cfg: JobConfig, dims: ParallelDims, mesh: DeviceMesh | None) -> None:
    """``parallelize`` with the job's options as the meta build applies them (meta_parallelism): the one call the dry
    run's stages and the exact memory step (tools/memory_run.py) share, so the two cannot drift apart."""
    parallelize_job(model, cfg, dims, mesh, meta_parallelism(cfg.parallelism))


def only_layers(model: nn.Module, names: list[str]) -> nn.Module:
    """A shallow view of ``model`` whose ``layers`` hold just the named blocks (shared, keys kept), so that the real
    ``prune_to_stage`` deep-copies one stage's blocks rather than all of them (16 x 126 blocks of 405B took 30 s)."""
    kept = {name.split(".", 1)[1] for name in names if name.startswith("layers.")}
    layers: nn.ModuleDict = model.layers  # type: ignore[assignment]
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._modules["layers"] = nn.ModuleDict({key: block for key, block in layers.items() if key in kept})
    return view


def build_parts(
    cfg: JobConfig, dims: ParallelDims, mesh: DeviceMesh | None, args: ModelArgs
) -> tuple[dict[int, list[tuple[int, list[str], nn.Module]]], str]:
    """Each pipeline rank's parallelized stages (meta device), and a line describing the pipeline."""
    parallelize_part = functools.partial(parallelize_meta, cfg=cfg, dims=dims, mesh=mesh)
    model = build_model(args)
    if dims.pp == 1:
        parallelize_part(model)
        return {0: [(0, module_order(args.n_layers), model)]}, "no pipeline: every rank holds every layer"
    summary, modules, stage_rank = pipeline_plan(cfg, dims, args.n_layers)
    parts: dict[int, list[tuple[int, list[str], nn.Module]]] = {p: [] for p in range(dims.pp)}
    for stage in sorted(stage_rank):
        part = prune_to_stage(only_layers(model, modules[stage]), modules[stage])
        parallelize_part(part)
        parts[stage_rank[stage]].append((stage, modules[stage], part))
    return parts, summary


def measure(pp_rank: int, stages: list[tuple[int, list[str], nn.Module]], optimizer: str) -> PipelineRank:
    """Local shard sizes of one pipeline rank's parameters, gradients and optimizer states (module docstring)."""
    out = PipelineRank(pp_rank, [(index, names) for index, names, _ in stages])
    for _, _, part in stages:
        for param in part.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            out.param_elements += local.numel()
            out.param_bytes += local.numel() * local.element_size()
    out.grad_bytes = out.param_bytes
    out.optimizer_bytes = OPTIMIZER_STATES[optimizer] * out.param_bytes
    return out


def placement_name(placement: Placement) -> str:
    if isinstance(placement, _StridedShard):  # FSDP's dim-0 shard of a tensor TP already split on dim 0
        return f"Shard(dim {placement.dim}, of the TP shard)"
    if isinstance(placement, Shard):
        return f"Shard(dim {placement.dim})"
    return type(placement).__name__


def describe_axes(parts: list[nn.Module], dims: ParallelDims, pipeline: str) -> dict[str, str]:
    """What each mesh axis does, read from the placements of the parameters the real code sharded."""
    placed: dict[str, dict[str, set[str]]] = {}
    for part in parts:
        for name, param in part.named_parameters():
            if not isinstance(param, DTensor):
                continue
            short = canonical_name(name).removesuffix(".weight")
            short = ".".join(p for p in short.split(".") if not p.isdigit()).removeprefix("layers.")
            for axis, placement in zip(param.device_mesh.mesh_dim_names or (), param.placements, strict=True):
                placed.setdefault(axis, {}).setdefault(placement_name(placement), set()).add(short)
    axes = {"pp": f"pipeline: {pipeline}"} if dims.pp > 1 else {}
    if dims.cp > 1:
        axes["cp"] = "context parallel: splits each sequence; its ranks join FSDP's sharding (dp_shard_cp)"
    for axis, by_placement in placed.items():
        kinds = "; ".join(f"{p}: {', '.join(sorted(names))}" for p, names in sorted(by_placement.items()))
        roles = {"tp": "tensor parallel", "ep": "expert parallel", "efsdp": "FSDP2 of the routed experts"}
        role = roles.get(axis, "FSDP2 (per block + root)" if "shard" in axis else "HSDP")
        axes[axis] = f"{role}; {kinds}"
    return axes


def plan(cfg: JobConfig, world_size: int) -> DryRun:
    """Validate ``cfg`` for ``world_size`` ranks and measure every pipeline rank's share (ValueError if invalid)."""
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size}: give the number of ranks of the job, e.g. --world-size 512")
    notes: list[str] = []
    target = target_device(cfg.training.device)
    dtype, why = resolve_param_dtype(cfg.training.mixed_precision_param, torch.device(target))
    if cfg.training.mixed_precision_param == "auto":
        notes.append(f"training.mixed_precision_param = auto: {dtype} on the {target} target ({why})")
        training = dataclasses.replace(cfg.training, mixed_precision_param=dtype)  # type: ignore[arg-type]
        cfg = dataclasses.replace(cfg, training=training)
    check_window(cfg.profiling)
    logging_ranks(cfg.job.log_rank, world_size)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    args = model_args(cfg, notes)
    Layout.from_config(cfg, world_size).check(args)  # training's and the planner's one rule set (parallel/layout.py)
    check_features(cfg, dims, target, notes, args)
    with fake_world(world_size):
        mesh = dims.build_mesh("cpu")  # meta tensors need a mesh of a type this torch can shard for
        parts, pipeline = build_parts(cfg, dims, mesh, args)
        ranks = [measure(p, stages, cfg.optimizer.name) for p, stages in sorted(parts.items())]
        axes = describe_axes([m for stages in parts.values() for _, _, m in stages], dims, pipeline)
    if cfg.training.dataset not in ("austen", "text"):
        notes.append(f"training.dataset = {cfg.training.dataset!r} streams from the network: not opened here")
    total = param_counts(args).total
    return DryRun(model_label(cfg.model), world_size, dims, target, total, ranks, axes, notes)


def compress(names: list[str]) -> str:
    """'tok_embeddings, layers.0, layers.1, layers.2' -> 'tok_embeddings, layers.0-2'."""
    out: list[str] = []
    layers = [int(n.split(".")[1]) for n in names if n.startswith("layers.")]
    for name in names:
        if not name.startswith("layers."):
            out.append(name)
        elif int(name.split(".")[1]) == layers[0]:
            out.append(f"layers.{layers[0]}-{layers[-1]}" if len(layers) > 1 else name)
    return ", ".join(out)


def format_report(r: DryRun) -> str:
    d = r.dims
    degrees = " x ".join(f"{a} {d.degree(a)}" for a in AXES if d.degree(a) > 1) or "a single rank"
    degrees += f" (ep {d.ep} x efsdp {d.efsdp} within dp_shard x cp)" if d.ep > 1 else ""
    lines = [
        f"meshforge dry run: {r.flavor} ({r.total_params / 1e9:.2f}B parameters) on {r.world_size} ranks "
        f"(target {r.target}; fake process group, meta device: nothing allocated, nothing sent)",
        f"layout: {degrees} = {d.world_size}",
        "mesh axes:",
        *[
            f"  {axis:<12} {d.degree(axis) if axis in (*AXES, 'ep', 'efsdp') else ''}  {text}"
            for axis, text in r.axes.items()
        ],
        "per-rank memory (rank at dp / cp / tp coordinate 0 of each pipeline rank; activations not counted):",
        f"  {'pp rank':>7}  {'params':>12}  {'param GiB':>9}  {'grad GiB':>8}  {'optim GiB':>9}  {'total GiB':>9}"
        "  stages",
    ]
    for p in r.ranks:
        stages = "; ".join(f"{i}: {compress(names)}" for i, names in p.stages)
        lines.append(
            f"  {p.pp_rank:>7}  {p.param_elements:>12,}  {p.param_bytes / GIB:>9.2f}  {p.grad_bytes / GIB:>8.2f}  "
            f"{p.optimizer_bytes / GIB:>9.2f}  {p.total_bytes / GIB:>9.2f}  {stages}"
        )
    lines += [f"note: {note}" for note in r.notes]
    lines.append("valid: this config and layout pass every check a real run makes before its first step")
    return "\n".join(lines)


def dry_run(cfg: JobConfig, world_size: int) -> int:
    """Print the layout and per-rank memory of ``cfg`` on ``world_size`` ranks; 0 if valid, 2 with one line if not."""
    try:
        report = plan(cfg, world_size)
    except ConfigError as exc:
        print(f"meshforge train --dry-run: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0
