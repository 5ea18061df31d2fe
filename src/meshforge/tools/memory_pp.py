"""`meshforge train --dry-run --memory` under pipeline parallel: a pipeline rank's stage with the schedule's
microbatches in flight, on fake tensors (tools/memory_run.py's conventions and scaling).

torch's pipelining stack is not run (its schedules exchange real tensors between stage processes); the stage is
modelled instead, stated in every record: the rank's blocks in one module (pruned as parallel/pipeline/split.py
prunes a stage: the embedding only on the first rank, norm + output + loss only on the last), parallelized as
training does on one pipeline rank's sub-mesh (FSDP with resharding off, as under PP), fed one microbatch
(``pipeline_parallel_microbatch_size`` sequences) at a time. The tracked window is the schedule's peak: as many
forwards held as the rank has stage-microbatches in flight (counted in the schedule's own order by
parallel/pipeline/simulator.py, as plan/physics/schedules.py counts them; divided by the rank's stages for an
interleaved schedule, whose forwards each run one stage's blocks while this module runs all the rank's), then the first
one's backward. Stage boundaries as parallel/pipeline/free_outputs.py leaves them: each held forward has its own
received input (a non-first rank; the first block's RMSNorm saves it), and a non-last rank's output is freed once sent
(its autograd node stays); inside the module the boundary between two of the rank's stages is the next stage's input.
One untracked microbatch before it runs forward + backward without gradient sync, so the unsharded gradients accumulate
as in the schedule's steady state (FSDP neither syncs nor reshards between microbatches under PP). The first and the
last pipeline ranks are traced (embedding vs output and loss); the record is the busier one's, the other in a note.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from meshforge.config.schema import JobConfig
from meshforge.model.flavors import ModelArgs
from meshforge.model.loss import cross_entropy, loss_parallel_context
from meshforge.parallel.context_parallel import resolve_cp_impl, shard_batch
from meshforge.parallel.cpu_offload import check_cpu_offload
from meshforge.parallel.dims import ParallelDims, sub_mesh
from meshforge.parallel.pipeline import catalog, simulator, split
from meshforge.parallel.pipeline.free_outputs import release_output
from meshforge.tools.dry_run import fake_world
from meshforge.tools.memory_run import (
    GIB,
    MemoryRun,
    build_adamw,
    build_step_model,
    build_tracker,
    categorize,
    fake_tensors,
    probed_run,
    step_autocast,
)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """What one pipeline rank holds and how many forwards its peak holds."""

    rank: int
    layers: int
    first: bool
    last: bool
    in_flight: int
    forwards: int


def stage_plans(cfg: JobConfig, args: ModelArgs) -> list[StagePlan]:
    """The first and last pipeline ranks' stages, split as training splits them (parallel/pipeline/split.py)."""
    par = cfg.parallelism
    pp = par.pipeline_parallel_degree
    schedule = catalog.canonical_schedule(par.pipeline_parallel_schedule) or par.pipeline_parallel_schedule
    style = catalog.SCHEDULE_STYLES[schedule][0]
    num_stages = split.num_stages_for(par, args.n_layers, pp, style)
    modules = split.stage_modules(par, args.n_layers, num_stages)
    m = cfg.training.local_batch_size // par.pipeline_parallel_microbatch_size
    shape = simulator.Shape(schedule, pp, m, num_stages // pp)
    plans = []
    for rank in sorted({0, pp - 1}):
        stages = catalog.stages_of_rank(schedule, pp, num_stages // pp, rank)
        in_flight = simulator.in_flight(shape, rank)
        layers = sum(sum(n.startswith("layers.") for n in modules[s]) for s in stages)
        forwards = max(1, round(in_flight / len(stages)))
        plans.append(StagePlan(rank, layers, 0 in stages, num_stages - 1 in stages, in_flight, forwards))
    return plans


def stage_config(cfg: JobConfig) -> JobConfig:
    """One pipeline rank's config: no pipeline, resharding off, one microbatch per forward."""
    par = dataclasses.replace(cfg.parallelism, pipeline_parallel_degree=1, fsdp_reshard_after_forward="never")
    mbs = cfg.parallelism.pipeline_parallel_microbatch_size
    training = dataclasses.replace(cfg.training, local_batch_size=mbs)
    return dataclasses.replace(cfg, parallelism=par, training=training)


def pp_memory_run(cfg: JobConfig, world_size: int, args: ModelArgs, dims: ParallelDims) -> MemoryRun:
    """The busier of the first and last pipeline ranks' peaks by category (module docstring)."""
    check_cpu_offload(cfg.training.enable_cpu_offload, fsdp_enabled=dims.fsdp_enabled)
    stage_cfg = stage_config(cfg)
    stage_world = world_size // dims.pp
    stage_dims = ParallelDims.from_config(stage_cfg.parallelism, stage_world)
    runs = []
    for plan in stage_plans(cfg, args):

        def trace(n: int, plan: StagePlan = plan) -> list[dict[str, int]]:
            probe_args = dataclasses.replace(args, n_layers=n)
            with fake_world(stage_world):
                mesh = stage_dims.build_mesh("cpu")
                model = build_step_model(stage_cfg, stage_dims, mesh, probe_args, stage=(plan.first, plan.last))
                with fake_tensors():
                    return tracked_stage(stage_cfg, model, mesh, probe_args, plan)

        runs.append((plan, probed_run(plan.layers, trace)))
    plan, run = max(runs, key=lambda r: r[1].peak_bytes)
    run.notes += [describe(p, r) for p, r in runs]
    return run


def describe(plan: StagePlan, run: MemoryRun) -> str:
    part = "embedding + " if plan.first else ""
    part += f"{plan.layers} blocks" + (" + norm, output, loss" if plan.last else "")
    held = f"{plan.forwards} forwards held ({plan.in_flight} stage-microbatches in flight)"
    return f"pipeline rank {plan.rank} ({part}; {held}): {run.peak_bytes / GIB:.2f} GiB, modelled stage (module doc)"


def tracked_stage(cfg: JobConfig, model: Any, mesh: Any, args: ModelArgs, plan: StagePlan) -> list[dict[str, int]]:
    """One synced step (creates the optimizer states), one unsynced microbatch, then under the tracker the peak's
    forwards and the first one's backward. Two instants: the tracker's peak and the forwards all held (the first
    backward's start), extrapolated each on its own (memory_run.probed_run)."""
    model.to_empty(device="cpu")
    optimizer = build_adamw(model, cfg)
    batch, seq = cfg.training.local_batch_size, cfg.training.seq_len
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    cp_impl = resolve_cp_impl(cfg.parallelism.context_parallel_impl, "cpu")
    tokens, labels, positions = shard_batch(sub_mesh(mesh, "cp"), cp_impl, tokens, tokens)
    local = tokens.shape[1]
    positions = (torch.arange(local) if positions is None else positions).expand(batch, -1)
    tp_mesh = sub_mesh(mesh, "tp")
    loss_parallel = tp_mesh is not None and not cfg.parallelism.disable_loss_parallel
    dtype = getattr(torch, cfg.training.mixed_precision_param)
    sp = tp_mesh.size() if tp_mesh is not None else 1  # the hidden states between stages are sequence-sharded

    def received() -> torch.Tensor:  # a stage-microbatch's receive buffer (its first block's norm saves it)
        return torch.randn(batch, local // sp, args.dim, dtype=dtype, requires_grad=True)

    chunked = plan.last and cfg.training.loss_chunks > 1  # the last stage's forward returns the chunked loss
    model.loss_chunks = cfg.training.loss_chunks

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        with loss_parallel_context(loss_parallel), step_autocast(cfg, model):
            if chunked:
                return model(inputs, positions, labels)
            out = model(inputs, positions)
            if plan.last:
                return cross_entropy(out, labels)
            release_output(out, aliases=0)  # sent: the stage keeps its autograd node only (free_outputs.py)
            return out

    def backward(out: torch.Tensor) -> None:
        with loss_parallel_context(loss_parallel):
            out.backward() if plan.last else out.backward(torch.ones_like(out))

    backward(forward(tokens if plan.first else received()))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _sync(model, False)
    backward(forward(tokens if plan.first else received()))
    inputs = [tokens if plan.first else received() for _ in range(plan.forwards)]
    tracker = build_tracker(model, optimizer)
    if hasattr(tracker, "track_inputs") and not plan.first:  # FSDPMemTracker: held as inputs, not temporaries
        tracker.track_inputs(inputs)
    with tracker:
        held = []
        for i in range(plan.forwards):
            if i:  # per-module stats only (the tracker refuses a root's second forward); the peak is kept
                tracker.reset_mod_stats()
            held.append(forward(inputs[i]))
        held_all = tracker.get_tracker_snapshot("current")
        backward(held.pop(0))
    snapshot = tracker.get_tracker_snapshot("peak")
    peak, held_peak = categorize(next(iter(snapshot.values()))), categorize(next(iter(held_all.values())))
    # the accumulated unsharded gradients are live at both instants, but out of the tracker's sight until the backward
    # touches them (FSDP2 keeps them on its FSDPParam, not in .grad): the peak's are the same storages
    held_peak["gradients_unsharded"] = max(held_peak.get("gradients_unsharded", 0), peak.get("gradients_unsharded", 0))
    return [peak, held_peak]


def _sync(model: Any, on: bool) -> None:
    """FSDP between microbatches under PP: no gradient reduce-scatter, no reshard after backward."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(on)
        model.set_reshard_after_backward(on)
