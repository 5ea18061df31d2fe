"""Layout: the shape of a parallel run (degrees, schedule, micro-batching, stage split, activation checkpointing and
the features and memory levers a strategy choice sets), the one rule set saying whether it can run a model, and the one
mapping back to `meshforge train` flags.

Training (train/loop.py, ``meshforge train --dry-run``, the bench's pre-flight) and the planner (plan/layout.py, which
builds one from its own job description) both ask ``Layout.check``, so they give the same verdict with the same
one-line ConfigError; the pipeline's rules are parallel/pipeline/rules.py's. ``to_train_flags`` is what the guide,
``--parallelism.auto`` and the bench's auto rows run a chosen layout with. Pure Python (no torch): ``meshforge plan``
checks layouts without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshforge.errors import ConfigError
from meshforge.parallel.degrees import Degrees, check_ep_compile, check_ep_degrees, check_ep_shape, degrees_from_config
from meshforge.parallel.pipeline.rules import check_pipeline

if TYPE_CHECKING:
    from meshforge.config.schema import JobConfig
    from meshforge.model.flavors import ModelArgs


@dataclass(frozen=True)
class Layout:
    """The degrees, schedule and micro-batching of a job, and the options its validity rules read."""

    degrees: Degrees
    seq_len: int
    local_batch_size: int = 1
    schedule: str = "1F1B"
    microbatch_size: int = 1
    grad_accum: int = 1
    compile: bool = False
    cpu_offload: bool = False
    layers_per_stage: int = -1
    first_stage_less_layers: int = 1
    last_stage_less_layers: int = 1
    stage_modules: tuple[tuple[str, ...], ...] = ()
    """parallelism.module_fqns_per_model_part: the stages' module names when given explicitly."""
    schedule_csv: str = ""
    """parallelism.pipeline_parallel_schedule_csv: a schedule read from a file (checked where it is read)."""
    reshard_after_forward: bool = True
    """FSDP reshards after forward (the policy resolved: ``resolve_reshard_after_forward``)."""
    ac_mode: str = "selective"
    sac_option: str = "op"
    cp_impl: str = "auto"
    float8: bool = False
    async_tp: bool = False
    loss_chunks: int = 1
    activation_offload: bool = False

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> Layout:
        """The layout of ``cfg`` at ``world_size`` processes (ConfigError when the degrees do not fit it)."""
        par = cfg.parallelism
        d = degrees_from_config(par, world_size)
        return cls(
            degrees=d,
            seq_len=cfg.training.seq_len,
            local_batch_size=cfg.training.local_batch_size,
            schedule=par.pipeline_parallel_schedule,
            microbatch_size=par.pipeline_parallel_microbatch_size,
            grad_accum=cfg.training.gradient_accumulation_steps,
            compile=cfg.compile.enable,
            cpu_offload=cfg.training.enable_cpu_offload,
            layers_per_stage=par.pipeline_parallel_layers_per_stage,
            first_stage_less_layers=par.pipeline_parallel_first_stage_less_layers,
            last_stage_less_layers=par.pipeline_parallel_last_stage_less_layers,
            stage_modules=tuple(tuple(names) for names in par.module_fqns_per_model_part),
            schedule_csv=par.pipeline_parallel_schedule_csv,
            reshard_after_forward=resolve_reshard_after_forward(par.fsdp_reshard_after_forward, d.pp > 1),
            ac_mode=cfg.activation_checkpoint.mode,
            sac_option=cfg.activation_checkpoint.selective_ac_option,
            cp_impl=par.context_parallel_impl,
            float8=cfg.quantize.dense.float8.enable,
            async_tp=par.enable_async_tensor_parallel,
            loss_chunks=cfg.training.loss_chunks,
            activation_offload=cfg.activation_checkpoint.offload,
        )

    def check(self, args: ModelArgs, *, other_stack: bool = False) -> None:
        """ConfigError naming the first reason this layout cannot run this model (each rule written once, here or in
        the parallel/degrees.py and parallel/pipeline/rules.py rules it calls). ``other_stack``: the planner pricing
        another stack's code (``--impl torchtitan``), where meshforge's own pipeline refusals do not apply."""
        d = self.degrees
        check_ep_degrees(d.ep, d.dp_shard, d.cp, d.dp_replicate)
        check_tp_shape(d.tp, args)
        check_ep_shape(d.ep, d.efsdp, args)
        check_seq_len(self.seq_len, cp=d.cp, tp=d.tp)
        check_ep_compile(d.ep, self.compile)
        check_tied_pipeline(args, d.pp)
        check_cpu_offload(self.cpu_offload, fsdp_enabled=d.fsdp_enabled)
        if d.pp > 1 and not self.schedule_csv:  # a CSV schedule is checked where it is read (pipeline/schedule.py)
            check_pipeline(
                args.n_layers,
                pp=d.pp,
                schedule=self.schedule,
                local_batch_size=self.local_batch_size,
                microbatch_size=self.microbatch_size,
                layers_per_stage=self.layers_per_stage,
                first_less=self.first_stage_less_layers,
                last_less=self.last_stage_less_layers,
                stage_modules=self.stage_modules,
                resharding=not other_stack and self.reshard_after_forward and d.fsdp_enabled,
            )

    def to_train_flags(self) -> list[str]:
        """The `meshforge train` flags (TorchTitan's spellings) that run this layout: the one mapping from a layout
        to training (``plan --guide``'s commands, ``--parallelism.auto``, the bench's auto rows)."""
        d = self.degrees
        out = ["--training.seq_len", str(self.seq_len), "--training.local_batch_size", str(self.local_batch_size)]
        out += ["--parallelism.data_parallel_shard_degree", str(d.dp_shard)]
        for key, value in (
            ("data_parallel_replicate_degree", d.dp_replicate),
            ("tensor_parallel_degree", d.tp),
            ("pipeline_parallel_degree", d.pp),
            ("context_parallel_degree", d.cp),
            ("expert_parallel_degree", d.ep),
        ):
            if value > 1:
                out += [f"--parallelism.{key}", str(value)]
        if d.pp > 1:
            out += ["--parallelism.pipeline_parallel_schedule", self.schedule]
            out += ["--parallelism.pipeline_parallel_microbatch_size", str(self.microbatch_size)]
        if d.cp > 1:
            out += ["--parallelism.context_parallel_impl", self.cp_impl]
        out += ["--activation_checkpoint.mode", self.ac_mode]
        if self.ac_mode == "selective":
            out += ["--activation_checkpoint.selective_ac_option", self.sac_option]
        for flag, on in (
            ("--compile.enable", self.compile),
            ("--quantize.dense.float8.enable", self.float8),
            ("--parallelism.enable_async_tensor_parallel", self.async_tp),
        ):
            out += [flag] if on else []
        out += ["--training.loss_chunks", str(self.loss_chunks)] if self.loss_chunks > 1 else []  # memory levers
        out += ["--activation_checkpoint.offload"] if self.activation_offload else []
        return out + (["--training.enable_cpu_offload"] if self.cpu_offload else [])


def resolve_reshard_after_forward(policy: str, pipeline_parallel: bool) -> bool:
    """FSDP's parallelism.fsdp_reshard_after_forward: default = reshard (free gathered weights after forward) unless
    pipeline parallel, where each microbatch would re-gather them and zero-bubble schedules' split backward would see
    resharded weights (wrong gradients)."""
    # Root cause of the wrong gradients (docs/pipeline.md): torch's input-gradient pass (stage_backward_input) picks
    # the weights to differentiate from `submod.parameters()`; after a reshard those are FSDP's sharded DTensors, not
    # the unsharded tensors the forward graph used, so the weight pass skips them and their gradients are lost.
    # parallel/pipeline/rules.py refuses 'always' with those schedules.
    if policy == "always":
        return True
    if policy == "never":
        return False
    return not pipeline_parallel


def check_tp_shape(tp: int, args: ModelArgs) -> None:
    """Tensor parallel splits the heads, the FFN, the hidden width and the vocabulary (loss parallel) evenly."""
    if tp == 1:
        return
    for key, size in (
        ("n_heads", args.n_heads),
        ("n_kv_heads", args.kv_heads),
        ("ffn hidden dim", args.ffn_hidden_dim),
        ("dim", args.dim),
        ("vocab", args.vocab_size),
    ):
        if size % tp:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree = {tp} does not divide the model's {key} ({size}); "
                f"choose a tensor-parallel degree that divides it"
            )


def check_seq_len(seq_len: int, *, cp: int, tp: int) -> None:
    """Context parallel's load balancing and sequence parallel split each sequence."""
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            f"training.seq_len = {seq_len} must be divisible by 2 x context_parallel_degree = {2 * cp} "
            "(load balancing splits each sequence into 2 x cp chunks)"
        )
    if tp > 1 and seq_len % (cp * tp):
        raise ConfigError(
            f"training.seq_len = {seq_len} must be divisible by context_parallel_degree x tensor_parallel_degree "
            f"= {cp * tp} (sequence parallel splits each rank's slice of the sequence)"
        )


def check_tied_pipeline(args: ModelArgs, pipeline_parallel_degree: int) -> None:
    """Tied embeddings cannot be split across pipeline stages."""
    if args.tie_embeddings and pipeline_parallel_degree > 1:
        raise ConfigError(
            f"model.tie_embeddings with parallelism.pipeline_parallel_degree = {pipeline_parallel_degree}: embedding "
            "and the output projection live on different stages; set tie_embeddings = 'false' or pipeline degree 1"
        )


def check_cpu_offload(enabled: bool, *, fsdp_enabled: bool) -> None:
    """CPU offload is FSDP's: refuse it, in one line, for a layout without FSDP."""
    if enabled and not fsdp_enabled:
        raise ConfigError(
            "training.enable_cpu_offload needs FSDP (it is FSDP2's CPUOffloadPolicy) but the layout has "
            "data_parallel_shard_degree x context_parallel_degree = 1 and no replicas; set "
            "parallelism.data_parallel_shard_degree >= 2 or training.enable_cpu_offload = false"
        )
