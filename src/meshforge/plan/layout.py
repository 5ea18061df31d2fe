"""The job the planner reasons about: degrees, batch, pipeline schedule and features, read from a JobConfig.

Pure Python (no torch). ``layout_from_config`` resolves what the config leaves open (data_parallel_shard_degree = -1,
the FSDP reshard policy, the pipeline's stages per rank) the way meshforge's training code does, and ``Layout.check``
rejects what cannot run with a one-line ConfigError: training's rule set (parallel/layout.py: heads not divisible by
TP, ...; the pipeline's, parallel/pipeline/rules.py), then the composability table's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from meshforge.config.io import ConfigError
from meshforge.config.schema import JobConfig
from meshforge.model.flavors import ModelArgs, get_flavor
from meshforge.model.hf_config import model_label, resolve_model_args
from meshforge.parallel.degrees import Degrees, resolve_dp_shard
from meshforge.parallel.layout import Layout as ParallelLayout
from meshforge.parallel.layout import resolve_reshard_after_forward
from meshforge.parallel.pipeline import catalog, rules, split
from meshforge.parallel.pipeline.catalog import MULTI_STAGE, SCHEDULES, SPLIT_BACKWARD, V_SHAPED

__all__ = ["MULTI_STAGE", "SCHEDULES", "SPLIT_BACKWARD", "V_SHAPED", "Layout"]
DEFAULT_STAGES_PER_RANK = 2
"""Stages per rank of multi-stage schedules when layers_per_stage is not given (TorchTitan's default)."""

IMPLEMENTATIONS = ("meshforge", "torchtitan")
"""Whose code the job runs. They differ where memory and speed notice: meshforge's selective-op AC saves every matmul
output and its RoPE rotates real pairs in fp32; TorchTitan's (Dec 2024, the article's) saves every other matmul output
and rotates complex numbers (fewer element-wise passes)."""


@dataclass(frozen=True)
class Layout:
    """Everything about a job that moves memory or speed; degrees multiply to the world size."""

    flavor: str
    seq_len: int
    local_batch_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert parallel: MoE experts split over ``ep`` of the dp_shard x cp ranks (not a factor of the world size)."""
    schedule: str = "1F1B"
    microbatch_size: int = 1
    stages_per_rank: int = 1
    layers_per_stage: int = -1
    first_stage_less_layers: int = 1
    last_stage_less_layers: int = 1
    grad_accum: int = 1
    ac_mode: str = "selective"
    sac_option: str = "op"
    impl: str = "meshforge"
    compile: bool = False
    float8: bool = False
    float8_all_gather: bool = True
    async_tp: bool = False
    reshard_after_forward: bool = True
    gradient_sync: str = "every_microstep"
    """[gradient_sync] mode (auto: the planner decides by memory, physics/peak.py resolve_gradient_sync);
    every_microstep for rows of other stacks, which exchange gradients every micro-step; regather: keep / reshard, or
    auto (resolved with the mode: keep where its peak fits, as training decides after its first step,
    train/regather.py)."""
    regather: str = "reshard"
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    accumulate_dtype: str = "float32"
    """gradient_sync.accumulate_dtype: the dtype unsharded gradients are summed in between exchanges (bf16 / fp16
    parameters only; fp32 ones sum in fp32: parallel/fsdp.py ``accumulate_in``)."""
    cp_impl: str = "auto"
    cp_gathers_gqa_kv: bool = False
    """Context parallel all-gathers K/V before they are repeated to the query heads (kv_heads of them: the Llama 3
    paper's CP, arXiv:2407.21783 section 3.3.2); False: after (meshforge and TorchTitan's models repeat K/V before
    SDPA, where torch's CP gathers them)."""
    compiled_loss: bool = False
    """The loss is torch.compile'd (TorchTitan with compile on from bbb1b61, 2025-04-02); meshforge compiles only
    the blocks."""
    threads_per_rank: int = 0
    """CPU ranks: compute threads of each (0 = as many as the hardware probe used)."""
    lean_saves: bool = True
    """model.lean_saves: the lean step's saves (model/lean.py, parallel/sequence_shard_saves.py; Megatron's scheme
    within 1.3 %, docs/benchmarks/memory-at-scale.md); False: autograd's op-by-op saves (plan/physics/memory.py), as
    TorchTitan's step saves (``impl torchtitan``; Megatron-based stacks' rows set it back: production.py)."""
    loss_chunks: int = 1
    """Memory levers (plan/physics/levers.py): training.loss_chunks, activation_checkpoint.offload and (below)
    training.enable_cpu_offload."""
    activation_offload: bool = False
    cpu_offload: bool = False
    model: ModelArgs | None = None
    """The shapes when they are not the named flavor's (hf_config or [model] overrides); ``flavor`` is then a label."""

    @functools.cached_property
    def degrees(self) -> Degrees:
        """The parallel degrees; parallel/degrees.py derives the sizes below, as for training's ParallelDims."""
        return Degrees(self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp, self.ep)

    @property
    def world_size(self) -> int:
        return self.degrees.world_size

    @property
    def dp(self) -> int:
        return self.degrees.dp

    @property
    def fsdp_size(self) -> int:
        """Ranks one parameter is sharded over (FSDP shards over dp_shard x cp)."""
        return self.degrees.fsdp_size

    @property
    def efsdp(self) -> int:
        """Ranks each expert-parallel rank's experts are FSDP-sharded over: dp_shard x cp / ep."""
        return self.degrees.efsdp

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def schedule_microbatches(self) -> int:
        """Microbatches one pipeline schedule step runs (gradient accumulation runs the schedule once per step)."""
        return self.local_batch_size // self.microbatch_size if self.pp > 1 else 1

    @property
    def num_microbatches(self) -> int:
        """Microbatches per optimizer step on one data-parallel rank."""
        return self.schedule_microbatches * self.grad_accum

    @property
    def microbatch_sequences(self) -> int:
        return self.microbatch_size if self.pp > 1 else self.local_batch_size

    @property
    def tokens_per_device_step(self) -> float:
        """Tokens one device accounts for per step: the dp rank's tokens over the ranks that share them."""
        return self.local_batch_size * self.seq_len * self.grad_accum / (self.cp * self.tp * self.pp)

    @property
    def parallel(self) -> ParallelLayout:
        """The layout as training holds it (parallel/layout.py), whose ``check`` is the one rule set."""
        return ParallelLayout(
            degrees=self.degrees,
            seq_len=self.seq_len,
            local_batch_size=self.local_batch_size,
            schedule=self.schedule,
            microbatch_size=self.microbatch_size,
            grad_accum=self.grad_accum,
            compile=self.compile,
            cpu_offload=self.cpu_offload,
            layers_per_stage=self.layers_per_stage,
            first_stage_less_layers=self.first_stage_less_layers,
            last_stage_less_layers=self.last_stage_less_layers,
            reshard_after_forward=self.reshard_after_forward,
            ac_mode=self.ac_mode,
            sac_option=self.sac_option,
            cp_impl=self.cp_impl,
            float8=self.float8,
            async_tp=self.async_tp,
            loss_chunks=self.loss_chunks,
            activation_offload=self.activation_offload,
        )

    def to_train_flags(self) -> list[str]:
        """The `meshforge train` flags that run this layout (parallel/layout.py ``Layout.to_train_flags``)."""
        return self.parallel.to_train_flags()

    def check(self, args: ModelArgs) -> None:
        """ConfigError naming the first reason this layout cannot run this model: training's rules (parallel/layout.py,
        the pipeline's among them), then the composability table's."""
        self.parallel.check(args, other_stack=self.impl != "meshforge")
        if self.impl not in IMPLEMENTATIONS:
            raise ConfigError(f"--impl {self.impl!r} is unknown; choose {', '.join(IMPLEMENTATIONS)}")
        if self.impl == "meshforge":
            check_composable(self)

    def describe(self) -> str:
        """One line: 'FSDP 8 x TP 8 x PP 8 (Interleaved1F1B, 16 x mb 2) | AC full | compile, Float8, async TP'."""
        parts = []
        for label, degree in (
            ("HSDP-replicate", self.dp_replicate),
            ("FSDP", self.dp_shard),
            ("CP", self.cp),
            ("TP", self.tp),
            ("PP", self.pp),
        ):
            if degree > 1:
                parts.append(f"{label} {degree}")
        text = " x ".join(parts) or "single device"
        if self.ep > 1:
            text += f" [EP {self.ep}]"
        if self.pp > 1:
            mbs = self.local_batch_size // self.microbatch_size
            text += f" ({self.schedule}, {mbs} x mb {self.microbatch_size})"
        ac = self.ac_mode if self.ac_mode != "selective" else f"selective-{self.sac_option}"
        feats = [
            name
            for name, on in (
                ("compile", self.compile),
                ("Float8", self.float8),
                ("async TP", self.async_tp and self.tp > 1),
                (f"chunked loss {self.loss_chunks}", self.loss_chunks > 1),
                ("activation offload", self.activation_offload),
                ("CPU offload", self.cpu_offload),
            )
            if on
        ]
        text += f" | lbs {self.local_batch_size} x seq {self.seq_len} | AC {ac}"
        return text + (f" | {', '.join(feats)}" if feats else "")


def layout_from_config(
    cfg: JobConfig, world_size: int, *, impl: str = "meshforge", auto_dtype: str = "bfloat16"
) -> Layout:
    """The layout a config describes at ``world_size`` devices; ConfigError if the degrees do not fit it.
    ``training.mixed_precision_param = auto`` becomes ``auto_dtype`` (training's rule: bfloat16 on GPUs; for a CPU
    profile the caller passes the faster dtype of its probe, plan.hardware.auto_param_dtype)."""
    par = cfg.parallelism
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size} must be >= 1")
    shard = resolve_dp_shard(par, world_size, world="--world-size", fix="the world size")  # as training resolves it
    schedule = normalize_schedule(par.pipeline_parallel_schedule, par.pipeline_parallel_schedule_csv)
    model_args = resolve_model_args(cfg.model, cfg.training.seq_len)
    layout = Layout(
        flavor=model_label(cfg.model),
        seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size,
        dp_replicate=par.data_parallel_replicate_degree,
        dp_shard=shard,
        tp=par.tensor_parallel_degree,
        pp=par.pipeline_parallel_degree,
        cp=par.context_parallel_degree,
        ep=par.expert_parallel_degree,
        schedule=schedule,
        microbatch_size=par.pipeline_parallel_microbatch_size,
        layers_per_stage=par.pipeline_parallel_layers_per_stage,
        first_stage_less_layers=par.pipeline_parallel_first_stage_less_layers,
        last_stage_less_layers=par.pipeline_parallel_last_stage_less_layers,
        grad_accum=cfg.training.gradient_accumulation_steps,
        ac_mode=cfg.activation_checkpoint.mode,
        sac_option=cfg.activation_checkpoint.selective_ac_option,
        impl=impl,
        compile=cfg.compile.enable,
        float8=cfg.quantize.dense.float8.enable,
        float8_all_gather=cfg.quantize.dense.float8.enable_fsdp_float8_all_gather,
        async_tp=par.enable_async_tensor_parallel,
        reshard_after_forward=resolve_reshard_after_forward(
            par.fsdp_reshard_after_forward, par.pipeline_parallel_degree > 1
        ),
        param_dtype=auto_dtype if cfg.training.mixed_precision_param == "auto" else cfg.training.mixed_precision_param,
        reduce_dtype=cfg.training.mixed_precision_reduce,
        accumulate_dtype=cfg.gradient_sync.accumulate_dtype,
        cp_impl=par.context_parallel_impl,
        loss_chunks=cfg.training.loss_chunks,
        lean_saves=cfg.model.lean_saves and impl == "meshforge",  # TorchTitan's step saves op by op
        activation_offload=cfg.activation_checkpoint.offload,
        cpu_offload=cfg.training.enable_cpu_offload,
        gradient_sync=cfg.gradient_sync.mode,
        regather=cfg.gradient_sync.regather,
        model=None if model_args == get_flavor(cfg.model.flavor).with_seq_len(cfg.training.seq_len) else model_args,
    )
    if layout.world_size != world_size:
        raise ConfigError(
            f"degrees dp_replicate {layout.dp_replicate} x dp_shard {layout.dp_shard} x cp {layout.cp} x tp "
            f"{layout.tp} x pp {layout.pp} = {layout.world_size}, but --world-size is {world_size}"
        )
    return with_stages(layout, layout_args(layout))


def layout_args(layout: Layout) -> ModelArgs:
    """The model shapes of a layout at its sequence length: its own ``model`` or its named flavor's."""
    args = layout.model if layout.model is not None else get_flavor(layout.flavor)
    return args.with_seq_len(layout.seq_len)


def normalize_schedule(name: str, csv_path: str = "") -> str:
    """The canonical schedule name (accepts TorchTitan spellings such as interleave_1f1b); a CSV file maps to 1F1B
    timing (its bubble is unknown to the planner)."""
    return "1F1B" if csv_path else rules.resolve_schedule_name(name)


def with_stages(layout: Layout, args: ModelArgs) -> Layout:
    """Fill stages_per_rank: 1 for single-stage schedules, else from layers_per_stage or the default of 2."""
    if layout.pp == 1:
        return replace(layout, stages_per_rank=1)
    if layout.schedule not in MULTI_STAGE:
        return replace(layout, stages_per_rank=1)
    if layout.layers_per_stage > 0:
        virtual = args.n_layers + layout.first_stage_less_layers + layout.last_stage_less_layers
        stages = -(-virtual // layout.layers_per_stage)
        return replace(layout, stages_per_rank=max(2, -(-stages // layout.pp)))
    return replace(layout, stages_per_rank=DEFAULT_STAGES_PER_RANK)


def check_composable(layout: Layout) -> None:
    """The composability table's refusals (parallel/composability.py): --search never proposes a refused cell."""
    from meshforge.config.schema import Parallelism
    from meshforge.parallel import composability

    section = Parallelism(enable_async_tensor_parallel=layout.async_tp, pipeline_parallel_schedule=layout.schedule)
    rows = composability.active_parallelisms(
        section,
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        ep=layout.ep,
        cp_impl=layout.cp_impl,
    )
    features = composability.active_features(
        ac_mode=layout.ac_mode,
        ac_option=layout.sac_option,
        compile_enabled=layout.compile,
        float8_recipe="tensorwise" if layout.float8 else "",
    )
    composability.check(rows, features)


def stage_layer_counts(n_layers: int, layout: Layout) -> list[int]:
    """Transformer blocks per stage, as training splits them (parallel.pipeline.split.split_evenly: the embedding and
    the output count as first/last_stage_less_layers blocks, the total is split evenly)."""
    return list(
        _layer_counts(n_layers, layout.num_stages, layout.first_stage_less_layers, layout.last_stage_less_layers)
    )


@functools.lru_cache(maxsize=4096)
def _layer_counts(n_layers: int, stages: int, first_less: int, last_less: int) -> tuple[int, ...]:
    names = split.split_evenly(n_layers, stages, first_less, last_less)  # ConfigError when the layers do not split
    return tuple(sum(name.startswith("layers.") for name in stage) for stage in names)


def stages_of_rank(layout: Layout, rank: int) -> list[int]:
    """Stage indices a pipeline rank holds: looped (r, r + pp, ...) or V-shaped (r, 2 pp - 1 - r)."""
    return catalog.stages_of_rank(layout.schedule, layout.pp, layout.stages_per_rank, rank)
