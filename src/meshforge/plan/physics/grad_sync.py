"""The gradient exchange per optimizer step ([gradient_sync], parallel/gradient_sync.py) as the planner sees it.

``once_per_step``: under gradient accumulation (no pipeline parallel) only the last micro-step reduce-scatters (and,
under HSDP, all-reduces); the others accumulate unsharded fp32 gradients: the whole local model in the reduce dtype
stays resident from the first micro-step's backward to the step's end (plan/physics/peak.py ``accumulated``).
``auto``: once per step when that fits the device, else every micro-step (the planner's decision; training's auto is
once per step under accumulation and reports no memory check of its own)."""

from __future__ import annotations

from dataclasses import replace

from meshforge.model.flavors import ModelArgs
from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.layout import Layout
from meshforge.plan.physics.peak import gradient_sync_once as once
from meshforge.plan.physics.peak import memory

__all__ = ["once", "resolve"]


def resolve(args: ModelArgs, layout: Layout, hw: HardwareProfile) -> Layout:
    """``layout`` with gradient_sync = auto decided: once per step when it fits ``hw``'s memory, else every
    micro-step (and every micro-step where it changes nothing: no accumulation, or pipeline parallel)."""
    if layout.gradient_sync != "auto":
        return layout
    every = replace(layout, gradient_sync="every_microstep")
    if layout.pp > 1 or layout.grad_accum == 1:
        return every
    candidate = replace(layout, gradient_sync="once_per_step")
    capacity = hw.spec.device_memory_gib(layout.world_size) - hw.spec.runtime_gib
    return candidate if memory(args, candidate, hw).peak <= capacity else every
