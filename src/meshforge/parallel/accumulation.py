"""``gradient_sync.mode = auto``, decided by memory: the one rule training (train/grad_accum.py, from what its first
step measured) and the planner (plan/physics/peak.py ``resolve_gradient_sync``, from its model of the step) apply.
Pure Python (no torch), so ``meshforge plan`` runs it without importing torch.

One exchange per optimizer step (parallel/gradient_sync.py) keeps every FSDP-managed parameter's unsharded gradient,
in the accumulation dtype (gradient_sync.accumulate_dtype), for the whole step, beside everything else the step
holds at its peak. ``auto`` takes it where::

    (rest + gradients) x (1 + slack) + reserve <= capacity

``gradients``: those unsharded gradient bytes; ``rest``: the step's peak allocated bytes without them; ``slack``: the
caching allocator's fragmentation on the allocated bytes (reserved / allocated - 1); ``reserve``: what the device
holds outside the allocator (the CUDA context, NCCL's communicators, workspaces: the planner's runtime_gib plus
framework_gib); ``capacity``: the device's memory (a CPU host's memory divided among the ranks on it). Otherwise every
micro-step exchanges (FSDP's default: sharded gradients only). No accumulation: every micro-step (there is one).
Pipeline parallel: once per step, at no memory cost (the schedule holds its stages' unsharded gradients over every
microbatch of a run anyway; the runs before the last only skip the closing reduction).
"""

from __future__ import annotations

from dataclasses import dataclass

ONCE, EVERY = "once_per_step", "every_microstep"


@dataclass(frozen=True)
class Budget:
    """One rank's device, in bytes: its capacity, what it holds outside the allocator, the allocator's slack."""

    capacity: float
    reserve: float = 0.0
    slack: float = 0.0


@dataclass(frozen=True)
class Need:
    """What one exchange per step would hold at the step's peak, in bytes: the unsharded gradients (accumulation
    dtype) and the rest of the peak."""

    gradients: float
    rest: float


def once_fits(need: Need, budget: Budget) -> bool:
    """Whether the step's peak with the unsharded gradients fits the device (module docstring)."""
    return (need.rest + need.gradients) * (1 + budget.slack) + budget.reserve <= budget.capacity


def resolve_mode(
    mode: str, accumulation_steps: int, *, pipeline: bool, need: Need | None = None, budget: Budget | None = None
) -> str:
    """``once_per_step`` or ``every_microstep`` for [gradient_sync] ``mode`` (auto: by memory, module docstring).
    ``need`` and ``budget`` are read only where memory decides (auto, accumulation, no pipeline)."""
    if mode != "auto":
        return mode
    if accumulation_steps <= 1:
        return EVERY
    if pipeline:
        return ONCE
    if need is None or budget is None:
        raise ValueError("gradient_sync auto under accumulation without a pipeline is decided by memory: pass both")
    return ONCE if once_fits(need, budget) else EVERY


def describe(need: Need, budget: Budget) -> str:
    """The sums behind a decision, in GiB (training's start-up line)."""
    gib = 2**30
    return (
        f"(peak {need.rest / gib:.2f} + unsharded gradients {need.gradients / gib:.2f} GiB) x {1 + budget.slack:.3f} "
        f"+ reserve {budget.reserve / gib:.2f} GiB vs {budget.capacity / gib:.2f} GiB"
    )
