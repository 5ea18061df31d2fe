"""Peak memory of a pipeline rank: what is live at the step's busiest instant, by category. Pure Python.

The terms are those the exact fake-tensor step measures (tools/memory_run.py; tests/unit/test_plan_memory_exact.py
holds them to tests/fixtures/exact_memory.json per category). The step has three candidate peaks; the largest wins
and its categories are reported:

- ``loss`` (the start of the backward, where every published layout the exact step traces peaks): parameters and
  optimizer states resident, no gradient (``zero_grad(set_to_none=True)`` freed the last step's), every block's saved
  activations, the head's saved inputs (the block stack's output and the final norm's saved copies, sharded under SP,
  and the output matmul's full-length input), the loss's logits (LOSS_*_BYTES_PER_LOGIT), and the weights FSDP keeps
  gathered: the last block (parallel/fsdp.py does not reshard it after forward) or, with resharding off, every block
  and the root.
- ``block`` (the first block's backward), when its working set (recompute, activation gradients, CP's gathered K/V)
  exceeds the loss's: the saved activations, that working set, the gathered weights above plus the block FSDP
  prefetches and the root (gathered again for the output's backward and held, with the output's unsharded gradient,
  until the root's post-backward at the very end), and the block's unsharded gradient in both dtypes.
- ``end`` (the end of the backward): every sharded gradient, the root gathered with its unsharded gradients.

Under pipeline parallel the in-flight microbatches' activations replace ``saved`` (schedules.in_flight), every block
stays gathered (resharding is off under PP, parallel/fsdp.py) and the microbatches' unsharded gradients accumulate in
gradient_sync.accumulate_dtype until the last one's reduce-scatter, beside the send / receive buffers of each stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from meshforge.device import memory_budget
from meshforge.model.flavors import ModelArgs
from meshforge.parallel.accumulation import Budget, Need, resolve_mode
from meshforge.plan.hardware import GIB, HardwareProfile
from meshforge.plan.layout import Layout
from meshforge.plan.physics import levers, schedules
from meshforge.plan.physics.memory import (
    COMPILED_LOSS_BYTES_PER_LOGIT,
    LOSS_BYTES_PER_LOGIT,
    LOSS_PARALLEL_BYTES_PER_LOGIT,
    NORM_EAGER_BYTES,
    STATE_BYTES,
    autocast,
    block_modes,
    offload_kept_bytes_per_token,
    routed_bytes_per_token,
    saved_bytes_per_token,
    transient_bytes_per_token,
)
from meshforge.plan.physics.parts import (
    DTYPE_BYTES,
    RankParts,
    blocks_numel,
    compute_view,
    gathered_layer_bytes,
    local_param_numel,
    part_numel,
    rank_parts,
)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak memory of the most loaded pipeline rank, by part (GiB)."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    comm_buffers: float
    allocator: float
    framework: float
    rank: int
    phase: str = "loss"
    """Which instant of the step the peak is (module docstring)."""
    host: float = 0.0
    """GiB held in host memory instead (FSDP CPU offload's state, activation offload's saves; not in the peak)."""

    @property
    def peak(self) -> float:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.comm_buffers
            + self.allocator
            + self.framework
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer,
            "activations": self.activations,
            "communication_buffers": self.comm_buffers,
            "allocator_slack": self.allocator,
            "framework_overhead": self.framework,
        } | ({"host_offloaded": self.host} if self.host else {})


@dataclass(frozen=True)
class PeakTerms:
    """Bytes one pipeline rank allocates at its peak, by category, hardware aside."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    phase: str
    host: float = 0.0
    """Bytes held on the host (FSDP CPU offload's fp32 state, activation offload's saves), not in the total."""

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers


def memory(args: ModelArgs, layout: Layout, hw: HardwareProfile) -> MemoryBreakdown:
    """The peak over the pipeline ranks (the first and last stages hold the embedding and the loss, the schedule decides
    which rank holds the most activations)."""
    return max((rank_memory(args, layout, hw, r) for r in range(layout.pp)), key=lambda m: m.peak)


def rank_memory(args: ModelArgs, layout: Layout, hw: HardwareProfile, rank: int) -> MemoryBreakdown:
    """Peak memory of one pipeline rank: the allocated terms, the fitted allocator slack on them, the fixed part."""
    layout = levers.effective(layout, hw)  # on a CPU profile the device is the host: offloads move nothing
    t = rank_allocated(args, layout, rank)
    eff = hw.efficiency
    return MemoryBreakdown(
        parameters=t.parameters / GIB,
        gradients=t.gradients / GIB,
        optimizer=t.optimizer / GIB,
        activations=t.activations / GIB,
        comm_buffers=t.buffers / GIB,
        allocator=t.total * eff.allocator_overhead / GIB,
        framework=eff.framework_gib,
        rank=rank,
        phase=t.phase,
        host=t.host / GIB,
    )


@functools.lru_cache(maxsize=8192)
def rank_allocated(args: ModelArgs, layout: Layout, rank: int) -> PeakTerms:
    """What one pipeline rank allocates at its peak (the largest of the module docstring's instants)."""
    parts = rank_parts(args, layout, rank)
    numel = local_param_numel(args, layout, parts)
    tokens = layout.microbatch_sequences * layout.seq_len / layout.cp
    view = compute_view(args, layout.tp, layout.ep)  # MoE: the active FFN width (args itself for dense flavors)
    per_layer = (saved_bytes_per_token(view, layout) + routed_bytes_per_token(args, layout)) * tokens
    per_layer += autocast_weight_bytes(args, layout)
    mean_stage = parts.layers / max(1, len(parts.stage_layers))
    # activation offload: the device keeps what one block's backward has brought back (plan/physics/levers.py)
    blocks = schedules.in_flight(layout, rank) * mean_stage
    all_saved = blocks * per_layer
    kept_layer = offload_kept_bytes_per_token(view, layout) * tokens if layout.activation_offload else 0.0
    saved = levers.device_saved(layout, all_saved, per_layer, blocks * kept_layer, kept_layer)
    transient = transient_bytes_per_token(view, layout) * tokens
    loss = loss_bytes(args, layout, tokens) if parts.head else 0.0
    g = _gathered(args, layout, parts)
    device = levers.device_state_numel(layout, numel)  # CPU offload: the fp32 state lives on the host
    host = (numel - device) * sum(STATE_BYTES.values()) + all_saved - saved  # the offloads' host bytes
    params, opt = device * STATE_BYTES["params"], device * STATE_BYTES["optimizer"]
    if layout.pp > 1:
        act = saved + max(transient, loss)
        return PeakTerms(params, 0.0, opt, act, g.kept + g.accumulated + g.p2p, "pipeline", host)
    acc = g.accumulated  # gradient_sync once per step: the earlier micro-steps' unsharded gradients
    phases: tuple[PeakTerms, ...] = (
        # regather = keep: a backward ends with every block gathered, until the next forward reshards each
        PeakTerms(params, 0.0, opt, 0.0, g.regathered + acc, "kept gathered", host),
        PeakTerms(params, 0.0, opt, saved + loss, g.kept + acc, "loss", host),
        PeakTerms(
            params, 0.0, opt, saved + transient, g.kept + g.prefetch + g.root + g.block_grad + acc, "block", host
        ),
        PeakTerms(params, device * STATE_BYTES["grads"], opt, transient + per_layer, g.end + acc, "end", host),
    )
    return max(phases, key=lambda t: t.total)


def loss_bytes(args: ModelArgs, layout: Layout, tokens: float) -> float:
    """The head's rank at the loss: its saved inputs (module docstring) and the loss's fp32 logits and gradients."""
    e, tp, d = DTYPE_BYTES[layout.param_dtype], layout.tp, args.dim
    norm = 2 * e if layout.compile else e + NORM_EAGER_BYTES  # compiled norm: its input and output (assumed)
    if layout.lean_saves:  # the final norm saves its input; the output matmul its full-length input
        norm = e
    head = tokens * d * (norm / tp + e)
    if layout.lean_saves and autocast(layout):  # the fp32 residual's norm input; the output weight's cast copy
        head = tokens * d * (4 / tp + e) + e * part_numel(args, "head", tp, 1)
    per_logit = LOSS_PARALLEL_BYTES_PER_LOGIT if tp > 1 else LOSS_BYTES_PER_LOGIT
    if layout.compiled_loss and tp == 1:  # under loss parallel: DTensor's decomposition, kept (not measured)
        per_logit = COMPILED_LOSS_BYTES_PER_LOGIT
    return head + per_logit * tokens * args.vocab_size / tp / layout.loss_chunks  # chunked loss: one chunk's logits


def autocast_weight_bytes(args: ModelArgs, layout: Layout) -> float:
    """Autocast's cast copy of each block's weights, saved by the matmuls for their backward, per block-micro-batch
    without checkpointing (memory.autocast); a checkpointed block casts again in backward."""
    if not (layout.lean_saves and autocast(layout)):
        return 0.0
    plain = block_modes(args, layout).get("none", 0.0)
    return plain * DTYPE_BYTES[layout.param_dtype] * part_numel(args, "block", layout.tp, 1)


@dataclass(frozen=True)
class Gathered:
    """Communication buffers (bytes): the weights FSDP keeps gathered after forward, the next block it prefetches in
    backward, the root gathered with the output's unsharded gradient, one block's unsharded gradient, what is live at
    the end of the backward, the microbatches' (PP) or micro-steps' (gradient_sync once per step) accumulated
    unsharded gradients (in gradient_sync.accumulate_dtype), the pipeline send / receive buffers, every block kept
    gathered between micro-steps (gradient_sync regather = keep)."""

    kept: float = 0.0
    prefetch: float = 0.0
    root: float = 0.0
    block_grad: float = 0.0
    end: float = 0.0
    accumulated: float = 0.0
    p2p: float = 0.0
    regathered: float = 0.0


def resolve_gradient_sync(args: ModelArgs, layout: Layout, hw: HardwareProfile) -> Layout:
    """``layout`` with [gradient_sync] auto decided by ``hw``'s memory: the mode by parallel/accumulation.py's rule,
    the one training applies after its first step (train/grad_accum.py); then regather auto keep where once per step
    with it still fits, else reshard (training measures the same after its first once-per-step step,
    train/regather.py)."""
    if layout.gradient_sync == "auto":
        layout = _resolve_mode(args, layout, hw)
    if layout.regather != "auto":
        return layout
    reshard = replace(layout, regather="reshard")
    if not gradient_sync_once(layout) or not (layout.fsdp_size > 1 or layout.dp_replicate > 1):
        return reshard
    keep = replace(layout, regather="keep")
    return keep if _fits(args, keep, hw) else reshard


def _resolve_mode(args: ModelArgs, layout: Layout, hw: HardwareProfile) -> Layout:
    pipeline, accumulation = layout.pp > 1, layout.grad_accum
    if pipeline or accumulation <= 1:  # decided without memory
        return replace(layout, gradient_sync=resolve_mode("auto", accumulation, pipeline=pipeline))
    need, budget = accumulation_inputs(args, layout, hw)
    return replace(layout, gradient_sync=resolve_mode("auto", accumulation, pipeline=False, need=need, budget=budget))


def accumulation_inputs(args: ModelArgs, layout: Layout, hw: HardwareProfile) -> tuple[Need, Budget]:
    """parallel/accumulation.py's inputs as the planner prices them: the once-per-step step's allocated peak (rank 0,
    regather auto probed as reshard) split into its accumulated unsharded gradients and the rest; the device's
    memory, with runtime_gib + framework_gib outside the allocator and allocator_overhead its slack."""
    once = replace(layout, gradient_sync="once_per_step")
    probe = levers.effective(replace(once, regather="reshard") if once.regather == "auto" else once, hw)
    gradients = _gathered(args, probe, rank_parts(args, probe, 0)).accumulated if gradient_sync_once(probe) else 0.0
    need = Need(gradients=gradients, rest=rank_allocated(args, probe, 0).total - gradients)
    reserve = (hw.spec.runtime_gib + hw.efficiency.framework_gib) * GIB
    budget = Budget(hw.spec.device_memory_gib(layout.world_size) * GIB, reserve, hw.efficiency.allocator_overhead)
    return need, budget


def _fits(args: ModelArgs, layout: Layout, hw: HardwareProfile) -> bool:
    """Training's rule (device/memory_budget.py ``fits``): the predicted reserved peak (allocator slack included)
    plus the runtime reserve outside the allocator within the device's memory."""
    capacity = hw.spec.device_memory_gib(layout.world_size)
    return memory_budget.fits(memory(args, layout, hw).peak, 0.0, 0.0, hw.spec.runtime_gib, capacity)


def gradient_sync_once(layout: Layout) -> bool:
    """gradient_sync once per step in effect: the non-last micro-steps skip the exchange (parallel/gradient_sync.py;
    pipeline stages keep torch's schedule's own)."""
    return layout.gradient_sync == "once_per_step" and layout.pp == 1 and layout.grad_accum > 1


def _gathered(args: ModelArgs, layout: Layout, parts: RankParts) -> Gathered:
    e, r = DTYPE_BYTES[layout.param_dtype], DTYPE_BYTES[layout.reduce_dtype]
    a = 4 if layout.param_dtype == "float32" else DTYPE_BYTES[layout.accumulate_dtype]  # parallel/fsdp.py accumulate_in
    tokens = layout.microbatch_sequences * layout.seq_len / layout.cp
    # parallel/pipeline/free_outputs.py: sent outputs keep their autograd node only, idle receive buffers are released;
    # a stage input is a block's saved activation; left: the gradient being received (one boundary, sequence-sharded).
    # TorchTitan's stages keep torch's (priced as a send and a receive buffer per stage, as the fit saw them)
    boundaries = 1 if layout.impl == "meshforge" else 2 * len(parts.stage_layers)
    p2p = boundaries * tokens * args.dim * e / layout.tp if layout.pp > 1 else 0.0
    if not (layout.fsdp_size > 1 or layout.dp_replicate > 1):
        return Gathered(p2p=p2p)
    layer_numel = part_numel(args, "block", layout.tp, 1)
    if args.is_moe:  # the mean block, gathered (routed experts: E / ep of them)
        layer_numel = blocks_numel(args, layout, parts, 1) // max(1, parts.layers)
    root_numel = part_numel(args, "embedding", layout.tp, 1) * parts.embedding
    head_numel = part_numel(args, "head", layout.tp, 1) * parts.head
    root_numel += head_numel
    block = gathered_layer_bytes(args, layout)
    keep_all = layout.pp > 1 or not layout.reshard_after_forward
    kept = parts.layers * block + root_numel * e if keep_all else min(1, parts.layers) * block
    # the microbatches' (PP) or the micro-steps' (gradient_sync once per step) unsharded gradients, accumulated
    accumulated = (parts.layers * layer_numel + root_numel) * a if layout.pp > 1 or gradient_sync_once(layout) else 0.0
    return Gathered(
        kept=kept,
        prefetch=0.0 if keep_all else block * (parts.layers > 1),
        root=0.0 if keep_all else root_numel * e + head_numel * e,
        block_grad=layer_numel * e,
        end=kept + head_numel * e if keep_all else (root_numel + head_numel) * e + layer_numel * (e + r),
        accumulated=accumulated,
        p2p=p2p,
        regathered=parts.layers * block + root_numel * e
        if gradient_sync_once(layout) and layout.regather == "keep"
        else 0.0,
    )
