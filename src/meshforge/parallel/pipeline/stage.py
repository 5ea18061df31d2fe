"""Pipeline parallelism: split the model into stages, parallelize each, run a torch.distributed.pipelining schedule.

``build_pipeline`` checks the whole layout first (schedule name or CSV, microbatches, stages per rank, module names,
compatibility with FSDP resharding and compile), so a bad configuration is a ValueError before any rank waits on
another. Then, for each stage this pipeline rank runs, it copies the meta-device model, keeps only the stage's modules,
hands the part to ``parallelize_part`` (TP / AC / compile / FSDP), materialises it and initialises it by parameter name
(so every stage holds exactly the weights the whole model would), and wraps it in a timed ``PipelineStage`` that frees
sent outputs and idle receive buffers (free_outputs.py).

``Pipeline.step`` runs one schedule step over a local batch and returns the true loss on every rank (the loss exists
only where the last stage runs; it is summed over the pipeline group).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineSchedule
from torch.distributed.tensor import DTensor

from meshforge.config.schema import ActivationCheckpoint, Parallelism, Training
from meshforge.errors import ConfigError
from meshforge.model.llama import Transformer
from meshforge.parallel.cpu_offload import materialize
from meshforge.parallel.dims import ParallelDims, sub_mesh
from meshforge.parallel.layout import resolve_reshard_after_forward
from meshforge.parallel.pipeline import rules
from meshforge.parallel.pipeline.bubble import (
    BusyClock,
    compute_actions,
    idle_shares_by_pp_rank,
    simulate_idle_shares,
    single_stage_theory,
)
from meshforge.parallel.pipeline.free_outputs import LeanPipelineStage
from meshforge.parallel.pipeline.schedule import (
    ScheduleSpec,
    build_schedule,
    check_microbatches,
    schedule_spec,
)
from meshforge.parallel.pipeline.split import (
    Style,
    check_stages_per_rank,
    num_stages_for,
    prune_to_stage,
    stage_modules,
    stage_to_rank,
)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ScaledLoss:
    """The training loss of one microbatch times ``scale`` (1 / (microbatches x accumulation steps)), timed as
    compute: the schedule then accumulates exactly the gradient of the mean loss, with no rescaling afterwards."""

    def __init__(self, loss_fn: LossFn, clock: BusyClock) -> None:
        self.loss_fn, self.clock, self.scale = loss_fn, clock, 1.0

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with self.clock.busy():
            return self.loss_fn(output, target) * self.scale


@dataclass
class Pipeline:
    """This rank's stages, the schedule that runs them, and what the bubble should be."""

    spec: ScheduleSpec
    schedule: _PipelineSchedule
    stages: list[LeanPipelineStage]
    pp_group: dist.ProcessGroup
    n_microbatches: int
    loss: ScaledLoss
    clock: BusyClock
    theory_idle: float
    labels_in_forward: bool = False  # chunked loss: the last stage's forward returns the loss (model/loss.py)
    reduce_grads: bool = True  # False: this schedule run keeps its gradients unreduced (parallel/gradient_sync.py)

    def stage_kwargs(self, labels: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
        """The keywords every stage's forward gets, split into microbatches with the batch: positions (batch, seq),
        and under the chunked loss the labels (only the last stage, which holds the output projection, reads them)."""
        out = {"positions": positions.expand(labels.shape[0], -1)}
        return out | ({"labels": labels} if self.labels_in_forward else {})

    @property
    def model_parts(self) -> list[nn.Module]:
        return [stage.submod for stage in self.stages]

    @property
    def has_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def step(
        self, inputs: torch.Tensor, labels: torch.Tensor, scale: float, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward + backward of a local batch (batch, seq), all microbatches; gradients are scaled by ``scale``.

        ``positions`` (seq,): the tokens' global positions under context parallel. Every stage gets them as a
        (batch, seq) keyword, split into microbatches with the batch: a later stage cannot read the sequence length
        from its input, which sequence parallel leaves sharded. Returns the mean loss of the batch (unscaled,
        detached) on every pipeline rank."""
        seq = inputs.shape[1]
        if positions is None:
            positions = torch.arange(seq, device=inputs.device)
        self.loss.scale = scale / self.n_microbatches
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        target = labels if self.has_last else None
        with self.clock.step(), self.deferred_reduction():
            self.schedule.step(
                *args, target=target, losses=losses, return_outputs=False, **self.stage_kwargs(labels, positions)
            )
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        if self.has_last:
            local = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]  # loss parallel
            total = torch.stack([loss.detach().float() for loss in local]).sum() / scale
        dist.all_reduce(total, group=self.pp_group)  # only the last stage's rank holds a non-zero loss
        return total

    @contextlib.contextmanager
    def deferred_reduction(self) -> Iterator[None]:
        """With ``reduce_grads`` False (a gradient-accumulation micro-step before the last), the schedule's closing
        REDUCE_GRAD (torch's ``perform_reduce_grad``: FSDP's reduce-scatter of the microbatches' summed gradients) is
        skipped: the stages keep their unsharded gradients, which the next runs add to, and the last run reduces
        them once. The stages' FSDP modules stay gathered in between (torch's nosync backward left them so)."""
        if self.reduce_grads:
            yield
            return
        for stage in self.stages:
            stage.perform_reduce_grad = _no_reduction  # type: ignore[method-assign]
        try:
            yield
        finally:
            for stage in self.stages:
                del stage.perform_reduce_grad  # back to the class's method

    def evaluate(
        self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward and loss only (``schedule.eval``) of a local batch; the mean loss on every pipeline rank. The
        bubble clock is left as it was: evaluation is not a training step. Split-backward schedules: torch's eval()
        runs their input-gradient actions too ("can't steal_bwd_input if this stage doesn't have backward"), so their
        evaluation is a schedule step whose gradients are dropped at once (the next step starts from zero anyway)."""
        if self.spec.split_backward:
            saved_clock = (self.clock.busy_s, self.clock.step_s, list(self.clock._events))
            with torch.enable_grad():  # validation runs under no_grad
                total = self.step(inputs, labels, 1.0, positions)
            for part in self.model_parts:
                part.zero_grad(set_to_none=True)
            self.clock.busy_s, self.clock.step_s, self.clock._events = saved_clock
            return total
        seq = inputs.shape[1]
        if positions is None:
            positions = torch.arange(seq, device=inputs.device)
        self.loss.scale = 1.0 / self.n_microbatches
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        saved = (self.clock.busy_s, self.clock.step_s, list(self.clock._events))
        self.schedule.eval(
            *args, target=labels if self.has_last else None, losses=losses, **self.stage_kwargs(labels, positions)
        )
        self.clock.busy_s, self.clock.step_s, self.clock._events = saved
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        if self.has_last:
            local = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]
            total = torch.stack([loss.detach().float() for loss in local]).sum()
        dist.all_reduce(total, group=self.pp_group)
        return total

    def metrics(self) -> dict[str, float]:
        """Measured idle share per pipeline rank since the last call, their mean and max, and the theory (in %).
        Collective over the pipeline group."""
        shares = idle_shares_by_pp_rank(self.clock, self.pp_group)
        out = {f"bubble_pct_pp{rank}": 100 * share for rank, share in enumerate(shares)}
        out["bubble_pct"] = 100 * sum(shares) / len(shares)
        out["bubble_pct_max"] = 100 * max(shares)
        out["bubble_theory_pct"] = 100 * self.theory_idle
        return out


def plan_stages(spec: ScheduleSpec, cfg: Parallelism, n_layers: int, pp: int) -> tuple[list[list[str]], dict[int, int]]:
    """Module names of every stage and the pipeline rank of every stage."""
    if spec.csv is None:
        num_stages = num_stages_for(cfg, n_layers, pp, spec.style)
        return stage_modules(cfg, n_layers, num_stages), stage_to_rank(num_stages, pp, spec.style)
    num_stages = len(spec.csv.stage_rank)
    style: Style = "single" if num_stages == pp else "loop"
    check_stages_per_rank(num_stages, pp, style, f"{spec.csv.path} runs {num_stages} stages")
    if cfg.module_fqns_per_model_part or cfg.pipeline_parallel_layers_per_stage > 0:
        split_stages = num_stages_for(cfg, n_layers, pp, style)
        if split_stages != num_stages:
            raise ConfigError(
                f"{spec.csv.path} runs {num_stages} stages but the stage split gives {split_stages}; make them agree"
            )
    return stage_modules(cfg, n_layers, num_stages), spec.csv.stage_rank


def _no_reduction(grad_scale_factor: int) -> None:
    """A stage's REDUCE_GRAD skipped (Pipeline.deferred_reduction)."""


@dataclass(frozen=True)
class PipelinePlan:
    """The validated pipeline of a job: schedule, microbatch count, module names per stage, stage -> pp rank."""

    spec: ScheduleSpec
    n_microbatches: int
    modules: list[list[str]]
    stage_rank: dict[int, int]


def plan_pipeline(
    parallelism: Parallelism,
    training: Training,
    dims: ParallelDims,
    n_layers: int,
    compile_enabled: bool,
    ac: ActivationCheckpoint | None = None,
) -> PipelinePlan:
    """The stage split and schedule, without building anything (used by training and the dry run); every rule is
    pipeline/rules.py's (``Layout.check`` asked them already, except a CSV schedule's, read here)."""
    spec = schedule_spec(parallelism.pipeline_parallel_schedule, parallelism.pipeline_parallel_schedule_csv, dims.pp)
    n_micro = rules.num_microbatches(training.local_batch_size, parallelism.pipeline_parallel_microbatch_size)
    modules, ranks = plan_stages(spec, parallelism, n_layers, dims.pp)
    check_microbatches(spec, n_micro, dims.pp, len(modules))
    resharding = dims.fsdp_enabled and resolve_reshard_after_forward(parallelism.fsdp_reshard_after_forward, True)
    rules.check_split_backward(spec.name, spec.split_backward, resharding=resharding)
    if spec.csv is not None:
        rules.check_csv_split_backward(
            spec.name,
            spec.split_backward,
            compile_enabled=compile_enabled,
            ac_mode=ac.mode if ac is not None else "none",
            ac_option=ac.selective_ac_option if ac is not None else "op",
        )
    return PipelinePlan(spec, n_micro, modules, ranks)


def build_pipeline(
    model: Transformer,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    *,
    parallelism: Parallelism,
    training: Training,
    compile_enabled: bool,
    device: torch.device,
    parallelize_part: Callable[[nn.Module], None],
    loss_fn: LossFn,
    ac: ActivationCheckpoint | None = None,
) -> Pipeline:
    """Validate the layout, build and initialise this rank's stages, and the schedule (see the module docstring)."""
    plan = plan_pipeline(parallelism, training, dims, model.args.n_layers, compile_enabled, ac)
    spec, n_micro, modules, ranks = plan.spec, plan.n_microbatches, plan.modules, plan.stage_rank
    pp_mesh = sub_mesh(mesh, "pp")
    assert pp_mesh is not None, "build_pipeline needs a mesh with a pp axis"
    pp_group, pp_rank = pp_mesh.get_group(), pp_mesh.get_local_rank()
    clock = BusyClock(device)
    stages: list[LeanPipelineStage] = []
    for index in sorted(s for s, r in ranks.items() if r == pp_rank):
        part = prune_to_stage(model, modules[index])
        parallelize_part(part)
        materialize(part, device, cpu_offload=training.enable_cpu_offload)
        part.init_weights(training.seed)
        part.train()
        stages.append(LeanPipelineStage(part, index, len(modules), device, group=pp_group, clock=clock))
    chunked = training.loss_chunks > 1  # the last stage's forward computes the loss from the labels keyword
    loss = ScaledLoss(loss_from_forward if chunked else loss_fn, clock)
    schedule = build_schedule(spec, stages, n_micro, loss)
    idle = theory_idle(schedule, dims.pp, n_micro)
    return Pipeline(spec, schedule, stages, pp_group, n_micro, loss, clock, idle, labels_in_forward=chunked)


def loss_from_forward(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss under the chunked loss: the last stage's output already is the microbatch's mean loss."""
    return output


def theory_idle(schedule: _PipelineSchedule, pp: int, n_microbatches: int) -> float:
    """Mean idle share over the pipeline ranks that the schedule predicts (module docstring of bubble.py)."""
    if not isinstance(schedule, PipelineScheduleMulti):
        return single_stage_theory(pp, n_microbatches)
    order = compute_actions(schedule.pipeline_order)
    shares = simulate_idle_shares(order, schedule._num_stages)
    return sum(shares) / len(shares)
