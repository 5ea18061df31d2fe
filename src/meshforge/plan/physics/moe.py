"""Planner terms of a mixture-of-experts model under expert parallel. Pure Python.

* Memory holds every expert (total parameters), compute uses top_k of them (active parameters, flops_per_token).
* Each rank keeps E / ep routed experts, sharded again over efsdp = dp_shard x cp / ep ranks by FSDP; the rest of
  the model is sharded over dp_shard x cp as in a dense model (parallel/expert_parallel.py, parallel/fsdp.py).
* Tokens travel by all-to-all: per MoE layer and micro-step, dispatch + combine in forward and the same two in
  backward, plus one forward pair again where backward recomputes the block (full AC, and per-op selective AC:
  the all-to-alls are not on its save list). Each rank sends (ep - 1) / ep of its tokens x top_k rows; the ep ranks
  are neighbours inside dp_shard x cp (with tp inside them), so the group stays on NVLink while ep x tp fits
  a host, else it crosses the inter-node network.
* Load imbalance: the busiest rank receives ``max_load`` x the mean rows; its all-to-all and expert activations are
  sized for that (the headroom), since the step waits for the slowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshforge.model.flavors import ModelArgs, param_counts
from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.layout import Layout
from meshforge.plan.physics import comm
from meshforge.plan.physics.parts import DTYPE_BYTES

ADAM_STATES = 2


@dataclass(frozen=True)
class MoEEstimate:
    total_params: int
    active_params: int
    expert_params_per_rank: int
    """Routed-expert parameters one rank holds: E / ep experts, 1 / efsdp of each."""
    expert_state_bytes_per_rank: float
    """Their fp32 master weights + gradients + Adam states."""
    all_to_all_seconds: float
    """Per optimizer step, all MoE layers, at max_load."""
    intra_node: bool
    imbalance_headroom_bytes: float
    """Extra activation bytes of the busiest rank over a perfectly balanced one (saved for backward)."""


def expert_link(layout: Layout, ep: int, hw: HardwareProfile) -> comm.Link:
    """The link of an ep group: ep neighbours within dp_shard x cp, each spanning the tp ranks inside them."""
    spec, eff = hw.spec, hw.efficiency
    cpu = not spec.is_gpu
    wait = spec.oversubscription(layout.world_size, layout.threads_per_rank) if cpu else 1.0
    if ep * layout.tp <= spec.devices_per_node:
        return comm.Link(spec.intra_node_bandwidth * eff.network, spec.intra_node_latency * wait, True, cpu)
    return comm.Link(spec.inter_node_bandwidth * eff.network, spec.inter_node_latency * wait, False, cpu)


def all_to_all(bytes_per_rank: float, n: int, link: comm.Link) -> float:
    """Seconds for an n-rank all-to-all where each rank sends ``bytes_per_rank`` in all ((n-1)/n leave it)."""
    if n <= 1 or bytes_per_rank <= 0:
        return 0.0
    return (n - 1) / n * bytes_per_rank / link.bandwidth + comm.latency_steps(n, link) * link.latency


def moe_estimate(args: ModelArgs, layout: Layout, ep: int, hw: HardwareProfile, max_load: float = 1.25) -> MoEEstimate:
    """Memory, all-to-all time and imbalance headroom of ``args`` (an MoE flavor) under ``layout`` with EP ``ep``."""
    counts = param_counts(args)
    n_moe = args.n_layers - args.first_k_dense
    efsdp = max(1, layout.dp_shard * layout.cp // ep)
    expert = 3 * args.dim * args.moe_ffn_dim
    per_rank = n_moe * (args.n_routed_experts // ep) * expert // efsdp // layout.pp
    e = DTYPE_BYTES[layout.param_dtype]
    tokens = layout.local_batch_size * layout.seq_len / layout.cp  # routed by one rank per micro-step
    rows = tokens * args.top_k
    # dispatch + combine, forward and backward, + again where backward recomputes the block: full AC, and per-op
    # selective AC too (the all-to-alls are not on its save list, parallel/activation_ckpt.py)
    if layout.ac_mode == "selective" and layout.sac_option != "op":  # every N-th block fully checkpointed
        passes = 4 + 2 / int(layout.sac_option)
    else:
        passes = 4 if layout.ac_mode == "none" else 6
    link = expert_link(layout, ep, hw)
    one = all_to_all(rows * args.dim * e * max_load, ep, link)
    a2a = passes * one * (n_moe / layout.pp) * layout.grad_accum
    saved_per_row = (2 * args.dim + 3 * args.moe_ffn_dim) * e  # expert input, output and SwiGLU hidden states
    headroom = (max_load - 1.0) * rows * saved_per_row * n_moe / layout.pp
    return MoEEstimate(
        total_params=counts.total,
        active_params=counts.active,
        expert_params_per_rank=per_rank,
        expert_state_bytes_per_rank=per_rank * 4.0 * (2 + ADAM_STATES),
        all_to_all_seconds=a2a,
        intra_node=link.intra_node,
        imbalance_headroom_bytes=headroom,
    )
