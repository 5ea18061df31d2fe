"""The planner's physics: step time and memory of one job layout on one hardware profile. Pure Python, no torch.

Step time = the microbatches through the stages (each stage: its blocks' forward + backward + recomputation, the head,
and the exposed tensor/context-parallel communication; under pipeline parallel the schedule is simulated with its
sends, simulator.py) + FSDP communication that compute cannot hide + the optimizer step (+ for MoE flavors the token
all-to-alls of expert parallel, plan/physics/moe.py, all exposed: meshforge waits on each before the experts run).
Compute is FLOPs over achieved FLOP/s (matmuls and flash attention separately) plus element-wise bytes over achieved
memory bandwidth; communication is alpha-beta (comm.py). What a rank holds is parts.py, its memory memory.py and
peak.py. The constants are hardware.Efficiency's; docs/planner.md derives every formula.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from meshforge.config.io import ConfigError
from meshforge.model.flavors import ModelArgs, causal_flops_per_token, flops_per_token
from meshforge.parallel.pipeline.simulator import StageCost, StepResult, simulate
from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.layout import Layout, layout_args, stage_layer_counts
from meshforge.plan.physics import comm, levers, schedules
from meshforge.plan.physics.comm import exposed
from meshforge.plan.physics.memory import OPTIMIZER_TRAFFIC_PER_PARAM, block_modes
from meshforge.plan.physics.moe import moe_estimate
from meshforge.plan.physics.parts import (
    DTYPE_BYTES,
    MAX_LOAD,
    RankParts,
    blocks_numel,
    compute_view,
    gathered_layer_bytes,
    linear_numel,
    local_param_numel,
    part_numel,
    rank_parts,
    routed_width_per_token,
)
from meshforge.plan.physics.peak import MemoryBreakdown, gradient_sync_once, memory, resolve_gradient_sync

ATTENTION_BWD_FACTOR = 2.5
"""Flash-attention backward FLOPs over forward: it recomputes the scores (5 matmuls against 2)."""
LOSS_TRAFFIC_PER_LOGIT = 40
"""Bytes moved per logit by the fp32 cross-entropy forward and backward (cast, log-softmax, gradient, cast back)."""
ROPE_TRAFFIC = {"meshforge": 48, "torchtitan": 20}
"""Eager RoPE bytes per q/k element: meshforge rotates real pairs in fp32 (cast, four muls, two adds, stack, cast back);
TorchTitan multiplies complex numbers (cast, one complex mul, cast back)."""
CP_MERGE_TRAFFIC = 16
"""Bytes per output element per CP step: each block's output and LSE merged in fp32 (r + w; twice that backward)."""


@dataclass(frozen=True)
class Rates:
    """What one device achieves: FLOP/s for block matmuls, the bf16 output matmul and attention; bytes/s."""

    matmul: float
    head_matmul: float
    attention: float
    memory: float
    nominal_peak: float


def rates(layout: Layout, hw: HardwareProfile) -> Rates:
    spec, eff = hw.spec, hw.efficiency
    scale = spec.thread_scale(layout.threads_per_rank)
    peak = spec.peak_fp32_flops if layout.param_dtype == "float32" else spec.peak_bf16_flops
    sustained = peak * spec.clock_derate * scale
    fp8 = eff.float8_speedup if layout.float8 and spec.peak_fp8_flops > 0 else 1.0
    return Rates(
        matmul=sustained * eff.matmul * fp8,
        head_matmul=sustained * eff.matmul,
        attention=sustained * eff.attention,
        memory=spec.memory_bandwidth * scale * eff.memory_bandwidth,
        nominal_peak=spec.peak_bf16_flops * scale,
    )


def elementwise_bytes_per_token(args: ModelArgs, layout: Layout) -> float:
    """Forward memory traffic of one block's element-wise ops per token on one TP rank (eager op by op, or fused
    by torch.compile into one read and one write per kernel). Counted from meshforge.model.llama's code."""
    e = DTYPE_BYTES[layout.param_dtype]
    d, q, kv, f = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim
    expand = 2 * e * (kv + q) if kv < q else 0.0
    if layout.compile:
        traffic = 8 * e * d + e * (q + kv) + e * (q + kv) + expand / 2 + 2 * e * q + 3 * e * f
    else:
        norms = 2 * (4 * e + 36) * d  # x.float() twice, pow, mean, mul, type_as, * weight
        rope = ROPE_TRAFFIC[layout.impl] * (q + kv)
        traffic = norms + rope + expand + 2 * e * q + 6 * e * d + 5 * e * f
        if layout.float8:  # eager Float8 casts and amax of every linear input
            traffic += (6 * d + f) * (2 * e + 1)
    return traffic / layout.tp


def recompute_fractions(args: ModelArgs, layout: Layout) -> tuple[float, float, float]:
    """Extra forward work in backward, as fractions of the forward (matmuls, attention, element-wise)."""
    mm = attn = ew = 0.0
    for mode, share in block_modes(args, layout).items():
        if mode == "full":
            mm, attn, ew = mm + share, attn + share, ew + share
        elif mode == "op":
            ew += share
            # every other matmul saved (meshforge and TorchTitan alike): wk, wo, w3 recomputed
            d, q, kv, f = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim
            again: float = kv * d + q * d + f * d
            if args.is_moe:  # compute_view: the routed experts' grouped matmuls are not on the save list at all
                again += 2 * d * routed_width_per_token(args, layout.ep) * layout.tp  # in f they count x tp
            mm += share * again / (2 * q * d + 2 * kv * d + 3 * f * d)
    return mm, attn, ew


@dataclass(frozen=True)
class LayerTimes:
    """One block, one microbatch, one device (seconds)."""

    forward: float
    backward: float
    attention_forward: float
    tp_comm: float
    cp_comm: float


@functools.lru_cache(maxsize=4096)
def layer_times(args: ModelArgs, layout: Layout, hw: HardwareProfile, r: Rates) -> LayerTimes:
    tokens = layout.microbatch_sequences * layout.seq_len / layout.cp
    linear = linear_numel(args, layout.tp)
    mm = 2 * tokens * linear / r.matmul
    if args.is_moe and layout.float8:  # compute_view: Float8 converts nn.Linear only, the routed experts stay bf16
        routed = 3 * args.dim * routed_width_per_token(args, layout.ep)
        mm += 2 * tokens * routed * (1 / r.head_matmul - 1 / r.matmul)
    attn = 2 * args.head_dim * args.n_heads / layout.tp * layout.seq_len * tokens / r.attention  # causal
    ew = elementwise_bytes_per_token(args, layout) * tokens / r.memory
    if layout.cp > 1:
        ew += CP_MERGE_TRAFFIC * layout.cp * args.n_heads * args.head_dim / layout.tp * tokens / r.memory
    rec_mm, rec_attn, rec_ew = recompute_fractions(args, layout)
    backward = (2 + rec_mm) * mm + (ATTENTION_BWD_FACTOR + rec_attn) * attn + (2 + rec_ew) * ew
    return LayerTimes(
        mm + attn + ew,
        backward,
        attn,
        tp_layer_comm(args, layout, hw, tokens),
        cp_layer_comm(args, layout, hw, tokens, attn, rec_attn),
    )


def tp_layer_comm(args: ModelArgs, layout: Layout, hw: HardwareProfile, tokens: float) -> float:
    """Exposed sequence-parallel all-gathers / reduce-scatters of one block (forward, backward, recomputation)."""
    if layout.tp == 1:
        return 0.0
    e = DTYPE_BYTES[layout.param_dtype]
    link = comm.axis_link(layout, ("tp",), hw)
    ag = comm.all_gather(tokens * args.dim * (1 if layout.float8 else e), layout.tp, link)
    bf = comm.all_gather(tokens * args.dim * e, layout.tp, link)
    mode_ops = {"full": 2 * ag + 2 * bf, "op": 2 * ag, "none": 0.0}
    recompute = sum(share * mode_ops[mode] for mode, share in block_modes(args, layout).items())
    total = 2 * ag + 2 * bf + 4 * bf + recompute
    if async_tp_credited(layout, hw):
        total *= 1 - hw.efficiency.async_tp_overlap
    return total


ASYNC_TP_CONFIRMED = ("torchtitan",)
"""Implementations whose async-TP overlap has been measured on GPUs (TorchTitan's published rows). meshforge's own
async TP has not yet run on a GPU, so the planner credits it no overlap (its TP communication stays exposed) until
scripts/gpu_check.py has found the fused ops in its compiled graph and a GPU run has measured the gain
(docs/planner.md, "What is credited")."""


def async_tp_credited(layout: Layout, hw: HardwareProfile) -> bool:
    """Whether async TP hides part of this layout's TP communication in the model."""
    return layout.async_tp and layout.compile and hw.spec.is_gpu and layout.tp > 1 and layout.impl in ASYNC_TP_CONFIRMED


def cp_layer_comm(
    args: ModelArgs, layout: Layout, hw: HardwareProfile, tokens: float, attn: float, rec_attn: float
) -> float:
    """Exposed K/V exchange of one block: gather K/V forward (and in recomputation), gather + reduce-scatter dK/dV
        backward, hidden only behind the local block's attention. A ring would hide each step behind the previous one's
    attention, but no GPU run has confirmed meshforge's (or measured TorchTitan's) ring, so it is credited as the
    all-gather (docs/planner.md, "What is credited")."""
    if layout.cp == 1:
        return 0.0
    e = DTYPE_BYTES[layout.param_dtype]
    heads = args.kv_heads if layout.cp_gathers_gqa_kv else args.n_heads  # K/V before / after their repeat
    kv_bytes = tokens * 2 * heads / layout.tp * args.head_dim * e * layout.cp  # the whole sequence
    one = comm.all_gather(kv_bytes, layout.cp, comm.axis_link(layout, ("cp",), hw))
    hidden = attn / layout.cp if hw.spec.comm_overlaps_compute else 0.0
    forward = exposed(one, hidden)
    backward = exposed(2 * one, ATTENTION_BWD_FACTOR * hidden)
    return (1 + rec_attn) * forward + backward


def head_time(args: ModelArgs, layout: Layout, hw: HardwareProfile, r: Rates, parts: RankParts) -> float:
    """Output projection (kept in bf16 under Float8) and the fp32 loss on the last stage; embedding/norm tensor
    parallel collectives on the first and last."""
    tokens = layout.microbatch_sequences * layout.seq_len / layout.cp
    total = 0.0
    if parts.head:
        logits = tokens * args.vocab_size / layout.tp
        total += 3 * 2 * logits * args.dim / r.head_matmul + logits * LOSS_TRAFFIC_PER_LOGIT / r.memory
    if layout.tp > 1:
        link = comm.axis_link(layout, ("tp",), hw)
        total += (
            2
            * (parts.head + parts.embedding)
            * comm.all_gather(tokens * args.dim * DTYPE_BYTES[layout.param_dtype], layout.tp, link)
        )
    return total


@dataclass(frozen=True)
class RankTime:
    """One pipeline rank: its busy time per microbatch and the pieces of it."""

    busy: float
    compute: float
    tp: float
    cp: float
    layer: LayerTimes
    parts: RankParts


def rank_time(args: ModelArgs, layout: Layout, hw: HardwareProfile, r: Rates, rank: int) -> RankTime:
    parts = rank_parts(args, layout, rank)
    lt = layer_times(compute_view(args, layout.tp, layout.ep), layout, hw, r)  # MoE: by the active parameters
    compute = parts.layers * (lt.forward + lt.backward) + head_time(args, layout, hw, r, parts)
    tp, cp = parts.layers * lt.tp_comm, parts.layers * lt.cp_comm
    return RankTime(compute + tp + cp, compute, tp, cp, lt, parts)


def fsdp_exposed(args: ModelArgs, layout: Layout, hw: HardwareProfile, rt: RankTime) -> float:
    """FSDP all-gathers and reduce-scatters (and HSDP all-reduces) compute cannot hide, per step: per block, the
    prefetched gather of the next block runs under this block's compute; the first gather and the last reduce do not,
    nor do the root's (embedding, norm, output)."""
    if layout.fsdp_size == 1 and layout.dp_replicate == 1:
        return 0.0
    e, r = DTYPE_BYTES[layout.param_dtype], DTYPE_BYTES[layout.reduce_dtype]
    link = comm.axis_link(layout, ("dp_shard", "cp"), hw)
    layer_numel = part_numel(args, "block", layout.tp, 1)
    if args.is_moe:  # the mean block (routed experts E / ep, gathered over efsdp: counted over dp_shard x cp)
        layer_numel = blocks_numel(args, layout, rt.parts, 1) // max(1, rt.parts.layers)
    root_numel = root_full_numel(args, layout, rt.parts)
    ag = comm.all_gather(gathered_layer_bytes(args, layout), layout.fsdp_size, link)
    rs = comm.reduce_scatter(layer_numel * r, layout.fsdp_size, link)
    root_ag = comm.all_gather(root_numel * e, layout.fsdp_size, link)
    root = root_ag + comm.reduce_scatter(root_numel * r, layout.fsdp_size, link)
    if layout.dp_replicate > 1:
        rep = comm.axis_link(layout, ("dp_replicate",), hw)
        rs += comm.all_reduce(layer_numel * r / layout.fsdp_size, layout.dp_replicate, rep)
        root += comm.all_reduce(root_numel * r / layout.fsdp_size, layout.dp_replicate, rep)
    lt, layers = rt.layer, rt.parts.layers
    fwd, bwd = lt.forward + lt.tp_comm / 2, lt.backward + lt.tp_comm / 2
    if not hw.spec.comm_overlaps_compute:  # CPU ranks: gloo runs on the cores compute needs
        fwd = bwd = 0.0
    gather = ag + (layers - 1) * exposed(ag, fwd)
    if layout.pp > 1:  # gathered once per step, reduced once after the last microbatch (the stage's post-backward)
        return gather + layers * rs + root
    n = layout.num_microbatches
    if gradient_sync_once(layout):  # the last micro-step exchanges; the others gather (parallel/gradient_sync.py)
        if not layout.reshard_after_forward:
            return gather + (n - 1) * root_ag + layers * exposed(rs, bwd) + rs + root
        regather = 0.0 if layout.regather == "keep" else gather  # keep: gathered from the backward before
        return (
            gather
            + (n - 1) * (regather + layers * exposed(ag, bwd) + root_ag)
            + layers * exposed(ag + rs, bwd)
            + rs
            + root
        )
    if layout.reshard_after_forward:
        return n * (gather + layers * exposed(ag + rs, bwd) + rs + root)
    return gather + n * (layers * exposed(rs, bwd) + rs + root)


def root_full_numel(args: ModelArgs, layout: Layout, parts: RankParts) -> int:
    """Elements of the TP-local embedding / final norm / output this rank gathers."""
    total = part_numel(args, "embedding", layout.tp, 1) if parts.embedding else 0
    return total + (part_numel(args, "head", layout.tp, 1) if parts.head else 0)


def stage_costs(args: ModelArgs, layout: Layout, hw: HardwareProfile, r: Rates, over: float) -> list[StageCost]:
    """Seconds of one microbatch through each pipeline stage (its blocks, exposed TP/CP communication, and the
    output and loss on the last), compute slowed ``over`` times; split into forward and backward like one block."""
    counts = stage_layer_counts(args.n_layers, layout)
    lt = layer_times(compute_view(args, layout.tp, layout.ep), layout, hw, r)
    forward_share = lt.forward / (lt.forward + lt.backward)
    costs = []
    for s, layers in enumerate(counts):
        parts = RankParts(layers, s == 0, s == len(counts) - 1, (layers,))
        compute = layers * (lt.forward + lt.backward) + head_time(args, layout, hw, r, parts)
        total = compute * over + layers * (lt.tp_comm + lt.cp_comm)
        costs.append(StageCost(forward_share * total, (1 - forward_share) * total))
    return costs


def pipeline_timeline(layout: Layout, hw: HardwareProfile) -> list[tuple[int, float, float, str]]:
    """The simulated pipeline step behind ``estimate``: (rank, start s, end s, action) of every action."""
    args = layout_args(layout)
    layout.check(args)
    trace: list[tuple[int, float, float, str]] = []
    if layout.pp > 1:
        pipeline_step(args, layout, hw, rates(layout, hw), trace)
    return trace


def pipeline_step(
    args: ModelArgs,
    layout: Layout,
    hw: HardwareProfile,
    r: Rates,
    trace: list[tuple[int, float, float, str]] | None = None,
) -> tuple[float, StepResult]:
    """The compute slowdown and the simulated microbatches of one step of a pipeline-parallel layout.

    On a CPU host a rank waiting for its inputs sleeps in a blocking receive, so only the busy ranks compete for the
    cores: the slowdown follows the busy share of a first simulation at full speed (GPUs: no slowdown)."""
    tokens = layout.microbatch_sequences * layout.seq_len / layout.cp
    message = tokens * args.dim * DTYPE_BYTES[layout.param_dtype] / layout.tp
    send = comm.p2p(message, comm.axis_link(layout, ("pp",), hw))
    spec = hw.spec
    over = 1.0
    if spec.node_cores:
        alone = schedules.simulate(layout, stage_costs(args, layout, hw, r, 1.0), send, spec.stage_overhead)
        over = spec.oversubscription(layout.world_size, layout.threads_per_rank, busy=alone.mean_busy / alone.makespan)
    costs = stage_costs(args, layout, hw, r, over)
    if trace is not None:  # the timeline draws every action
        return over, simulate(layout, costs, send, spec.stage_overhead * over, trace)
    return over, schedules.simulate(layout, costs, send, spec.stage_overhead * over)


@dataclass
class Estimate:
    """The prediction for one layout on one hardware profile."""

    layout: Layout
    hardware: str
    memory: MemoryBreakdown
    time: dict[str, float]
    step_time: float
    tps_per_device: float
    mfu_pct: float  # model/flavors.MFU_LABEL: TorchTitan's convention, attention counted in full
    mfu_causal_pct: float  # model/flavors.MFU_CAUSAL_LABEL: attention halved (Megatron-Bridge)
    capacity_gib: float
    runtime_gib: float
    warnings: list[str] = field(default_factory=list)
    sync: tuple[str, str] = ("", "")  # [gradient_sync] mode, regather as priced (auto resolved: peak.py)

    @property
    def peak_memory_gib(self) -> float:
        return self.memory.peak

    @property
    def fits(self) -> bool:
        return self.memory.peak + self.runtime_gib <= self.capacity_gib

    def to_dict(self) -> dict[str, Any]:
        """The JSON form printed by ``meshforge plan --json``."""
        return {
            "tps_per_device": round(self.tps_per_device, 2),
            "peak_memory_gib": round(self.peak_memory_gib, 2),
            "mfu_pct": round(self.mfu_pct, 2),
            "mfu_causal_pct": round(self.mfu_causal_pct, 2),
            "fits": self.fits,
            "capacity_gib": round(self.capacity_gib - self.runtime_gib, 2),
            "step_time_s": round(self.step_time, 4),
            "hardware": self.hardware,
            "layout": self.layout.describe(),
            "world_size": self.layout.world_size,
            "breakdown": {
                "memory_gib": {k: round(v, 3) for k, v in self.memory.as_dict().items()},
                "memory_peak_pipeline_rank": self.memory.rank,
                "step_time_s": {k: round(v, 5) for k, v in self.time.items()},
            },
            "warnings": self.warnings,
        }


def estimate(layout: Layout, hw: HardwareProfile) -> Estimate:
    """Predict memory and throughput of ``layout`` on ``hw``; ConfigError if the layout cannot run the model."""
    args = layout_args(layout)
    layout.check(args)
    check_hardware(layout, hw)
    asked, layout = layout, resolve_gradient_sync(args, layout, hw)  # gradient_sync = auto: once per step where it fits
    r = rates(layout, hw)
    ranks = sorted({0, layout.pp - 1} | set(range(min(layout.pp, 4))))
    slowest = max((rank_time(args, layout, hw, r, k) for k in ranks), key=lambda t: t.busy)
    m = layout.num_microbatches
    tp, cp = m * slowest.tp, m * slowest.cp
    if layout.pp > 1:  # the busiest rank of the simulated schedule; idle time is sends on the critical path or bubble
        over, sim = pipeline_step(args, layout, hw, r)  # one schedule step of grad_accum
        g = layout.grad_accum
        sends = g * min(sim.exposed_sends, sim.makespan - sim.busy)  # sends on the critical path, up to the idle time
        compute, bubble = g * sim.busy - tp - cp, g * (sim.makespan - sim.busy) - sends
    else:
        over = hw.spec.oversubscription(layout.world_size, layout.threads_per_rank)
        compute, sends, bubble = m * slowest.compute * over, 0.0, 0.0
    numel = local_param_numel(args, layout, slowest.parts)
    times = {
        "compute": compute,
        "exposed_tp_comm": tp,
        "exposed_cp_comm": cp,
        "exposed_fsdp_comm": fsdp_exposed(args, layout, hw, slowest),
        "exposed_pp_comm": sends,
        "pipeline_bubble": bubble,
    }
    times["optimizer"] = numel * OPTIMIZER_TRAFFIC_PER_PARAM / r.memory * over
    times |= levers.lever_times(args, layout, hw, r, slowest.parts, numel, compute)  # memory levers
    if args.is_moe:  # token all-to-alls: exposed, none overlapped with compute (meshforge waits on each at once)
        times["exposed_ep_comm"] = moe_estimate(args, layout, layout.ep, hw, MAX_LOAD).all_to_all_seconds
    step = sum(times.values())
    tps = layout.tokens_per_device_step / step
    return Estimate(
        layout=asked,
        hardware=hw.name,
        memory=memory(args, layout, hw),
        time=times,
        step_time=step,
        tps_per_device=tps,
        mfu_pct=100 * tps * flops_per_token(args, layout.seq_len) / r.nominal_peak,
        mfu_causal_pct=100 * tps * causal_flops_per_token(args, layout.seq_len) / r.nominal_peak,
        capacity_gib=hw.spec.device_memory_gib(layout.world_size),
        runtime_gib=hw.spec.runtime_gib,
        warnings=layout_warnings(layout, hw),
        sync=(layout.gradient_sync, layout.regather),
    )


def check_hardware(layout: Layout, hw: HardwareProfile) -> None:
    """What meshforge refuses on this kind of device (CUDA-only features on a CPU profile)."""
    if hw.spec.is_gpu:
        return
    if layout.async_tp and layout.tp > 1:
        raise ConfigError(f"async tensor parallel needs CUDA symmetric memory; {hw.name} has none")
    if layout.cp > 1 and layout.cp_impl == "ring":
        raise ConfigError(f"context_parallel_impl = 'ring' needs CUDA; use 'allgather' or 'auto' on {hw.name}")


def layout_warnings(layout: Layout, hw: HardwareProfile) -> list[str]:
    """Options that have no effect on this hardware, said once each."""
    out = []
    if layout.float8 and hw.spec.peak_fp8_flops == 0:
        out.append(f"Float8 has no fp8 tensor cores to use on {hw.name}: no speedup modelled")
    if layout.async_tp and layout.tp > 1 and not layout.compile:
        out.append("async TP needs compile.enable: modelled as plain TP")
    elif layout.async_tp and layout.tp > 1 and hw.spec.is_gpu and layout.impl not in ASYNC_TP_CONFIRMED:
        out.append("async TP: no overlap credited until a GPU run confirms meshforge's (modelled as plain TP)")
    if layout.cp > 1 and layout.cp_impl == "ring":
        out.append("ring CP: no hiding credited until a GPU run confirms it (modelled as the all-gather)")
    return out
