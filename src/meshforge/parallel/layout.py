"""Layout: the shape of a parallel run (degrees, schedule, micro-batching) and the one rule set saying whether it
can run a model. Training (train/loop.py, ``meshforge train --dry-run``, the bench's pre-flight) and the planner
(plan/layout.py, which builds one from its own job description) both ask ``Layout.check``, so they give the same verdict
with the same one-line ConfigError. Pure Python (no torch): ``meshforge plan`` checks layouts without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshforge.errors import ConfigError
from meshforge.parallel.degrees import Degrees, check_ep_compile, check_ep_degrees, check_ep_shape, degrees_from_config

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

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> Layout:
        """The layout of ``cfg`` at ``world_size`` processes (ConfigError when the degrees do not fit it)."""
        par = cfg.parallelism
        return cls(
            degrees=degrees_from_config(par, world_size),
            seq_len=cfg.training.seq_len,
            local_batch_size=cfg.training.local_batch_size,
            schedule=par.pipeline_parallel_schedule,
            microbatch_size=par.pipeline_parallel_microbatch_size,
            grad_accum=cfg.training.gradient_accumulation_steps,
            compile=cfg.compile.enable,
            cpu_offload=cfg.training.enable_cpu_offload,
        )

    def check(self, args: ModelArgs) -> None:
        """ConfigError naming the first reason this layout cannot run this model (each rule written once, here or in
        the parallel/degrees.py rule it calls)."""
        d = self.degrees
        check_ep_degrees(d.ep, d.dp_shard, d.cp, d.dp_replicate)
        check_tp_shape(d.tp, args)
        check_ep_shape(d.ep, d.efsdp, args)
        check_seq_len(self.seq_len, cp=d.cp, tp=d.tp)
        check_ep_compile(d.ep, self.compile)
        check_tied_pipeline(args, d.pp)
        check_cpu_offload(self.cpu_offload, fsdp_enabled=d.fsdp_enabled)


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
