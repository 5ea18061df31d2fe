"""Which expert-parallel degrees a job may use: the rules training enforces (ParallelDims.validate_ep / validate_moe)
and the planner reuses. Pure Python (no torch), so ``meshforge plan`` checks a layout without importing torch."""

from __future__ import annotations

from meshforge.errors import ConfigError
from meshforge.model.flavors import ModelArgs


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
