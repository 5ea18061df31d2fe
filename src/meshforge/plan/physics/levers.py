"""The memory levers' terms (issue 25): what each moves off the device and what it costs per step.

* chunked loss (``training.loss_chunks = N``): the loss-time logits bytes (the fp32 logits, their gradient and the
  cross-entropy's temporaries: memory.py's loss term) shrink to one chunk's, / N; the cost is one more forward of the
  output projection per token in backward (the recompute): 2 x dim x vocab / tp FLOPs per token.
* activation offload (``activation_checkpoint.offload``): the saved activations go to host memory in forward and
  come back in backward; the device keeps what one block's backward has brought back, and per-op SAC's cached op
  outputs, which the checkpoint's own saved-tensor hooks hold on the device (memory.offload_kept_bytes_per_token;
  full AC's block inputs and a block without AC move whole). Each moved byte crosses the
  host link twice per step; meshforge copies on the compute stream (parallel/activation_offload.py), so no overlap
  is credited (``ACTIVATION_OFFLOAD_OVERLAP``).
* FSDP CPU offload (``training.enable_cpu_offload``): parameters, gradients and optimizer states (16 B per local
  parameter) live on the host. Per step every FSDP all-gather first copies its fp32 shard host-to-device (forward,
  and again in backward when FSDP reshards after forward), every reduce-scattered gradient goes device-to-host; FSDP
  issues both on its own streams, so they hide behind compute as far as compute lasts; the optimizer step runs on the
  host CPU at ``HOST_OPTIMIZER_BANDWIDTH``.

On CPU hardware profiles the two offloads save nothing (the device is the host); the chunked loss still does.
Host-link and host-optimizer figures are datasheet-derived assumptions, not measurements (docs/benchmarks/
memory-levers.md): no GPU run has checked them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from meshforge.model.flavors import ModelArgs
from meshforge.plan.hardware import GIB, HardwareProfile
from meshforge.plan.layout import Layout
from meshforge.plan.physics.comm import exposed
from meshforge.plan.physics.memory import (
    OPTIMIZER_TRAFFIC_PER_PARAM,
    offload_kept_bytes_per_token,
    routed_bytes_per_token,
    saved_bytes_per_token,
)
from meshforge.plan.physics.parts import RankParts, compute_view

if TYPE_CHECKING:
    from meshforge.plan.physics.estimate import Rates

HOST_LINK_BANDWIDTH = {"a100": 25e9}
"""Effective host <-> device bytes/s per GPU, one direction: PCIe Gen4 x16 on A100 (~25 of 32 GB/s)."""
DEFAULT_HOST_LINK_BANDWIDTH = 50e9
"""PCIe Gen5 x16 (H100, H200, B200): ~50 of 64 GB/s per direction, per GPU (each GPU its own x16 link)."""
ACTIVATION_OFFLOAD_OVERLAP = 0.0
"""Share of the activation copies hidden behind compute: 0, save_on_cpu copies on the current stream."""
HOST_OPTIMIZER_BANDWIDTH = 20e9
"""Bytes/s one rank's host-side AdamW (torch foreach on CPU) moves: a 2-socket host's ~600 GB/s DRAM shared by 8
ranks, of which a torch CPU optimizer reaches about a third (assumed, not measured)."""
HOST_MEMORY_BYTES = {"a100": 1e12 / 8}
"""Host memory per GPU that offloads may fill: DGX A100's 1 TB system memory over 8 GPUs (datasheet)."""
DEFAULT_HOST_MEMORY_BYTES = 2e12 / 8
"""DGX H100 / H200 / B200: 2 TB system memory over 8 GPUs (datasheets); the OS and data loaders' share is not
subtracted, so a layout near this bound is optimistic."""
SHARD_BYTES = 4  # fp32 sharded parameters copied host-to-device before each all-gather, fp32 gradients back

LEVER_NAMES = {"loss_chunks": "chunked loss", "activation_offload": "activation offload", "cpu_offload": "CPU offload"}


def active(layout: Layout) -> list[str]:
    """The levers a layout uses, as short labels ('chunked loss 8', 'activation offload', 'CPU offload')."""
    out = [f"chunked loss {layout.loss_chunks}"] if layout.loss_chunks > 1 else []
    return out + [LEVER_NAMES[k] for k in ("activation_offload", "cpu_offload") if getattr(layout, k)]


def offloads_apply(hw: HardwareProfile) -> bool:
    """Host offloads move memory only where the device is not the host."""
    return hw.spec.is_gpu


def effective(layout: Layout, hw: HardwareProfile) -> Layout:
    """The layout as far as device memory goes: without the host offloads where they move nothing."""
    if offloads_apply(hw) or not (layout.activation_offload or layout.cpu_offload):
        return layout
    return replace(layout, activation_offload=False, cpu_offload=False)


def host_link(hw: HardwareProfile) -> float:
    return HOST_LINK_BANDWIDTH.get(hw.spec.name, DEFAULT_HOST_LINK_BANDWIDTH)


OFFLOAD_BLOCKS_BACK = 2
"""Blocks of offloaded activations on the device in backward: the block being differentiated and the one before it,
whose copies back training starts early (parallel/activation_offload.py's prefetch; tools/memory_run.py models it)."""


def device_saved(layout: Layout, saved: float, per_layer: float, kept: float, kept_layer: float) -> float:
    """Saved-activation bytes on the device at the peak: all ``saved`` of them, or under activation offload the ones
    offload cannot move (``kept``: per-op SAC's cached outputs, memory.offload_kept_bytes_per_token) and the moved
    part of ``OFFLOAD_BLOCKS_BACK`` blocks: the one whose backward has them back and the one prefetched behind it (the
    chunked loss's share is plan/physics/peak.py's loss term, / N)."""
    if not layout.activation_offload:
        return saved
    per_layer, kept_layer = OFFLOAD_BLOCKS_BACK * per_layer, OFFLOAD_BLOCKS_BACK * kept_layer
    return kept + min(per_layer - kept_layer, saved - kept)


def host_memory_gib(hw: HardwareProfile) -> float:
    """GiB of host memory one GPU's rank may hold offloaded (FSDP CPU offload's state, activation offload's saves)."""
    return HOST_MEMORY_BYTES.get(hw.spec.name, DEFAULT_HOST_MEMORY_BYTES) / GIB


def device_state_numel(layout: Layout, numel: int) -> int:
    """Local parameters whose fp32 state (params, grads, AdamW) stays on the device: none under CPU offload."""
    return 0 if layout.cpu_offload else numel


def lever_times(
    args: ModelArgs, layout: Layout, hw: HardwareProfile, r: Rates, parts: RankParts, numel: int, compute: float
) -> dict[str, float]:
    """Seconds per step each active lever adds on the busiest rank (``compute``: its compute seconds per step).
    Under CPU offload the ``optimizer`` entry replaces estimate.py's device-side optimizer step."""
    m = layout.num_microbatches
    tokens = layout.microbatch_sequences * layout.seq_len / layout.cp
    out: dict[str, float] = {}
    if layout.loss_chunks > 1 and parts.head:
        out["chunked_loss_recompute"] = m * 2 * tokens * args.dim * args.vocab_size / layout.tp / r.head_matmul
    if layout.activation_offload and offloads_apply(hw):
        view = compute_view(args, layout.tp, layout.ep)
        saved = saved_bytes_per_token(view, layout) - offload_kept_bytes_per_token(view, layout)
        per_layer = (saved + routed_bytes_per_token(args, layout)) * tokens  # what offload moves (SAC's cache stays)
        copy = 2 * m * parts.layers * per_layer / host_link(hw)  # out in forward, back in backward
        out["activation_offload_copies"] = (1 - ACTIVATION_OFFLOAD_OVERLAP) * copy
    if layout.cpu_offload and offloads_apply(hw):
        gathers = m * (2 if layout.reshard_after_forward else 1)
        copies = (gathers + m) * numel * SHARD_BYTES / host_link(hw)
        out["cpu_offload_copies"] = exposed(copies, compute)
        out["optimizer"] = numel * OPTIMIZER_TRAFFIC_PER_PARAM / HOST_OPTIMIZER_BANDWIDTH
    return out


LADDER: tuple[dict[str, object], ...] = (
    {"loss_chunks": 8},
    {"activation_offload": True},
    {"loss_chunks": 8, "activation_offload": True},
    {"cpu_offload": True},
    {"loss_chunks": 8, "cpu_offload": True},
    {"loss_chunks": 8, "activation_offload": True, "cpu_offload": True},
)
"""Lever settings the search tries on a layout that does not fit, cheapest first by the terms above on 8B / 70B
H100 layouts (chunked loss: ~2 % of the step; activation offload: the saved bytes twice over PCIe; CPU offload:
the host optimizer step). The first that fits is kept."""


def ladder(layout: Layout, hw: HardwareProfile) -> list[Layout]:
    """The lever variants of ``layout`` the search tries (only those that can move memory on ``hw``), each keeping
    what the layout already set."""
    out = []
    for setting in LADDER:
        if not offloads_apply(hw) and any(k != "loss_chunks" for k in setting):
            continue
        if "cpu_offload" in setting and layout.fsdp_size * layout.dp_replicate == 1:
            continue  # FSDP's policy: training refuses it without FSDP (parallel/cpu_offload.py)
        merged = {k: max(v, getattr(layout, k)) for k, v in setting.items()}  # type: ignore[call-overload]
        variant = replace(layout, **merged)  # type: ignore[arg-type]
        if variant != layout:
            out.append(variant)
    return out
