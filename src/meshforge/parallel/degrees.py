"""The parallel degrees of a job, resolved and checked without torch: training (parallel/dims.py, which builds the
DeviceMesh from them) and the planner (plan/layout.py) read a config's degrees through here, so both resolve
``data_parallel_shard_degree = -1`` and derive the world / data-parallel / FSDP sizes the same way.

Also the rules on which expert-parallel degrees a job may use (``check_ep_*``): training enforces them
(ParallelDims.validate_ep / validate_moe / validate_features) and the planner reuses them. Pure Python (no torch), so
``meshforge plan`` checks a layout without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshforge.errors import ConfigError

if TYPE_CHECKING:
    from meshforge.config.schema import Parallelism
    from meshforge.model.flavors import ModelArgs

_POSITIVE = ("data_parallel_replicate_degree", "context_parallel_degree", "tensor_parallel_degree")


@dataclass(frozen=True)
class Degrees:
    """Degrees of each parallel axis; their product is the world size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1
    """Expert parallel: a split of dp_shard x cp (the ``ep`` axis of the expert mesh)."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks one parameter is sharded over (FSDP shards over dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks that shard each expert-parallel rank's experts with FSDP: dp_shard x cp / ep."""
        return self.fsdp_size // self.ep

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over dp_shard x cp (context-parallel ranks hold different tokens, so their gradients differ)."""
        return self.fsdp_size > 1 or self.dp_replicate > 1

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that work on the same data: tokens/s per device divides by this (TorchTitan's definition)."""
        return self.cp * self.tp * self.pp


def resolve_dp_shard(
    par: Parallelism, world_size: int, *, world: str = "the world size", fix: str = "the number of processes"
) -> int:
    """``data_parallel_shard_degree``, with -1 resolved to the rest of ``world_size`` (``world``, ``fix``: how the
    caller's user names the world size and what to change, for the error)."""
    others = par.data_parallel_replicate_degree * par.context_parallel_degree
    others *= par.tensor_parallel_degree * par.pipeline_parallel_degree
    if par.data_parallel_shard_degree != -1:
        return par.data_parallel_shard_degree
    if world_size % others:
        raise ConfigError(
            f"{world} {world_size} is not divisible by data_parallel_replicate x context x tensor x pipeline degrees "
            f"= {others}; change the degrees or {fix}"
        )
    return world_size // others


def check_degree_values(par: Parallelism) -> None:
    """Every degree >= 1 (data_parallel_shard_degree may be -1: the rest of the world size)."""
    for key in _POSITIVE:
        if getattr(par, key) < 1:
            raise ConfigError(f"parallelism.{key} = {getattr(par, key)} must be >= 1 (1 disables it)")
    if par.pipeline_parallel_degree < 1:
        raise ConfigError(f"parallelism.pipeline_parallel_degree = {par.pipeline_parallel_degree} must be >= 1")
    if par.data_parallel_shard_degree < 1 and par.data_parallel_shard_degree != -1:
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree = {par.data_parallel_shard_degree} must be >= 1 or -1 "
            "(the rest of the world size)"
        )


def degrees_from_config(par: Parallelism, world_size: int) -> Degrees:
    """The checked degrees of ``par`` at ``world_size`` processes: each >= 1, -1 resolved, the product equal to the
    world size, the expert-parallel degree a split of dp_shard x cp."""
    check_degree_values(par)
    degrees = Degrees(
        par.pipeline_parallel_degree,
        par.data_parallel_replicate_degree,
        resolve_dp_shard(par, world_size),
        par.context_parallel_degree,
        par.tensor_parallel_degree,
        par.expert_parallel_degree,
    )
    if degrees.world_size != world_size:
        raise ConfigError(
            f"parallel degrees pp {degrees.pp} x dp_replicate {degrees.dp_replicate} x dp_shard {degrees.dp_shard} x "
            f"cp {degrees.cp} x tp {degrees.tp} = {degrees.world_size} but the world size is {world_size}; make the "
            "product equal the number of processes (data_parallel_shard_degree = -1 fills in the rest)"
        )
    check_ep_degrees(degrees.ep, degrees.dp_shard, degrees.cp, degrees.dp_replicate)
    return degrees


def check_ep_degrees(ep: int, dp_shard: int, cp: int, dp_replicate: int) -> None:
    """Expert parallel borrows from the data-parallel shard x context ranks."""
    if ep < 1:
        raise ConfigError(f"parallelism.expert_parallel_degree = {ep} must be >= 1 (1 disables it)")
    if ep > 1 and (dp_shard * cp) % ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} must divide data_parallel_shard x context degrees "
            f"= {dp_shard * cp}; choose a divisor of it"
        )
    if ep > 1 and dp_replicate > 1:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} with data_parallel_replicate_degree = "
            f"{dp_replicate} (HSDP) is not supported yet; use data_parallel_shard_degree instead"
        )


def check_ep_shape(ep: int, efsdp: int, args: ModelArgs) -> None:
    """Expert-parallel degrees against the MoE shape (``efsdp`` = dp_shard x cp / ep shards each expert)."""
    if ep == 1:
        return
    if not args.is_moe:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} needs an MoE flavor (n_routed_experts > 0); "
            "set it to 1 or pick an MoE model.flavor"
        )
    if args.n_routed_experts % ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} does not divide the {args.n_routed_experts} routed "
            "experts; choose a divisor of the expert count"
        )
    for key, size in (("moe_ffn_dim", args.moe_ffn_dim), ("dim", args.dim)):
        if size % efsdp:
            raise ConfigError(
                f"the experts' FSDP degree dp_shard x cp / ep = {efsdp} does not divide the model's {key} "
                f"({size}); change parallelism.expert_parallel_degree or data_parallel_shard_degree"
            )


def check_ep_compile(ep: int, compile_enabled: bool) -> None:
    """torch.compile cannot trace the data-dependent all-to-all sizes."""
    if ep > 1 and compile_enabled:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} with compile.enable = true is not supported (the "
            "token all-to-all sizes are data-dependent); set compile.enable = false"
        )
