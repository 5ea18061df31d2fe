"""The sections that choose the parallel layout and how each rank computes: [parallelism] (the degrees, the pipeline's
schedule and stage split), [activation_checkpoint], [compile] and [quantize]. Read by parallel/layout.py
``Layout.from_config`` (the layout training and the planner hold) and applied by parallel/parallelize.py; the rest of
the job's sections are config/schema.py's, which gathers them all into JobConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from meshforge.errors import ConfigError, require_positive


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """HSDP replicas (DDP-style replication across groups of FSDP shards)."""
    data_parallel_shard_degree: int = -1
    """FSDP sharding degree; -1 = whatever the world size leaves after the other degrees."""
    context_parallel_degree: int = 1
    """Ranks that split each sequence (context parallel)."""
    tensor_parallel_degree: int = 1
    """Ranks that split each layer's matrices (tensor parallel, with sequence parallel on norms)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages' ranks (pipeline parallel)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: default = always, except never with pipeline parallel."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with matmuls (needs compile.enable and CUDA symmetric memory)."""
    disable_loss_parallel: bool = False
    """Gather the vocab-sharded logits before the loss instead of computing a vocab-parallel loss."""
    enable_sequence_parallel: bool = True
    """Shard norms and residuals along the sequence under tensor parallel."""
    context_parallel_impl: Literal["auto", "allgather", "ring"] = "auto"
    """allgather: gather K/V over cp; ring: pass K/V rank to rank (less K/V memory); auto: allgather. Any device."""
    pipeline_parallel_schedule: str = "1F1B"
    """GPipe, 1F1B, Interleaved1F1B (interleave_1f1b), LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV."""
    pipeline_parallel_schedule_csv: str = ""
    """A CSV file defining the schedule (see docs/pipeline.md); overrides pipeline_parallel_schedule."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline microbatch; the local batch must be a multiple."""
    pipeline_parallel_layers_per_stage: int = -1
    """Transformer blocks per stage (-1: split evenly into as many stages as the schedule needs)."""
    pipeline_parallel_first_stage_less_layers: int = 1
    """Blocks fewer on the first stage (it also holds the embedding)."""
    pipeline_parallel_last_stage_less_layers: int = 1
    """Blocks fewer on the last stage (it also holds the norm and output projection)."""
    module_fqns_per_model_part: list[list[str]] = field(default_factory=list)
    """Explicit module names per stage, e.g. [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]."""
    expert_parallel_degree: int = 1
    """Ranks that split each MoE layer's routed experts (tokens travel by all-to-all); borrowed from the
    data_parallel_shard x context ranks, the rest shard the experts with FSDP."""
    local_ranks: int = 0
    """Run this many ranks inside one process with torch's local tensors (meshforge train --local-ranks N): every
    rank's shard is a real tensor, collectives are computed locally; 0 = off (docs/parallelism.md)."""

    def validate(self) -> None:
        if self.local_ranks < 0 or self.local_ranks == 1:
            raise ConfigError(
                f"parallelism.local_ranks = {self.local_ranks} must be 0 (off) or >= 2 (ranks simulated in one process)"
            )
        for key in (
            "data_parallel_replicate_degree",
            "context_parallel_degree",
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "pipeline_parallel_microbatch_size",
            "expert_parallel_degree",
        ):
            require_positive(f"parallelism.{key}", getattr(self, key))
        if self.data_parallel_shard_degree == 0 or self.data_parallel_shard_degree < -1:
            raise ConfigError(
                f"parallelism.data_parallel_shard_degree = {self.data_parallel_shard_degree} "
                "must be >= 1 or -1 (the rest)"
            )


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "selective"
    """none, full (recompute every block) or selective."""
    selective_ac_option: str = "op"
    """For mode=selective: 'op' (save matmul/attention outputs, recompute the rest) or N (every N-th block)."""
    offload: bool = False
    """Keep the tensors autograd saves for backward in host memory (pinned on CUDA), copied back in backward
    (parallel/activation_offload.py); composes with every mode (it offloads what the mode saves)."""

    def validate(self) -> None:
        option = self.selective_ac_option
        if option != "op" and not (option.isdigit() and int(option) >= 1):
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option = {option!r} must be 'op' or a positive integer"
            )


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (and the loss)."""
    backend: str = "inductor"
    """torch.compile backend."""


@dataclass
class Float8:
    enable: bool = False
    """Float8 training of linear layers via torchao (CUDA needs compute capability >= 8.9)."""
    recipe_name: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Scaling granularity."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers (name substrings) kept in high precision."""
    enable_fsdp_float8_all_gather: bool = True
    """With tensorwise scaling under FSDP, all-gather weights in Float8."""
    emulate: bool | Literal["auto"] = "auto"
    """Emulate Float8 matmuls in high precision: auto = on a CPU (no Float8 kernels), real kernels on CUDA."""


@dataclass
class DenseQuantize:
    float8: Float8 = field(default_factory=Float8)


@dataclass
class Quantize:
    dense: DenseQuantize = field(default_factory=DenseQuantize)
