"""The search's use of the memory levers (plan/physics/levers.py): a candidate layout that does not fit is retried with
the levers' ladder (cheapest first) and kept with the first setting that fits; the report says which lever made it fit,
the memory it saved and the time it costs."""

from __future__ import annotations

from dataclasses import replace

from meshforge.config.io import ConfigError
from meshforge.model.flavors import ModelArgs
from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.layout import Layout
from meshforge.plan.physics import levers
from meshforge.plan.physics.estimate import Estimate
from meshforge.plan.physics.peak import memory, rank_memory

LEVER_TIME_KEYS = ("chunked_loss_recompute", "activation_offload_copies", "cpu_offload_copies")


def fitting_lever(args: ModelArgs, layout: Layout, hw: HardwareProfile, usable: float) -> Layout | None:
    """The first variant of ``layout`` on the levers' ladder whose peak fits ``usable`` GiB on the device and whose
    offloaded bytes fit the host's share per GPU (levers.host_memory_gib), or None."""
    for variant in levers.ladder(layout, hw):
        try:
            variant.check(args)
        except ConfigError:
            continue
        if rank_memory(args, variant, hw, 0).peak > usable:
            continue
        peak = memory(args, variant, hw)
        if peak.peak <= usable and peak.host <= levers.host_memory_gib(hw):
            return variant
    return None


def without_levers(layout: Layout) -> Layout:
    return replace(layout, loss_chunks=1, activation_offload=False, cpu_offload=False)


def explain(est: Estimate, hw: HardwareProfile, args: ModelArgs) -> str:
    """One line for a layout that uses levers: which, the peak without and with them, and their time per step."""
    names = levers.active(est.layout)
    if not names:
        return ""
    before = memory(args, without_levers(est.layout), hw).peak
    cost = sum(est.time.get(k, 0.0) for k in LEVER_TIME_KEYS)
    if est.layout.cpu_offload and levers.offloads_apply(hw):
        cost += est.time["optimizer"]  # the host-side step (the device-side one it replaces is ~0.5 % of it)
    usable = est.capacity_gib - est.runtime_gib
    verdict = "made it fit" if before > usable else "in use (it fits without too)"
    return (
        f"lever: {' + '.join(names)} {verdict}: peak {before:.1f} -> {est.peak_memory_gib:.1f} GiB (usable "
        f"{usable:.1f}), costing {cost:.3f} s of the {est.step_time:.3f} s step ({100 * cost / est.step_time:.1f} %)"
    )
