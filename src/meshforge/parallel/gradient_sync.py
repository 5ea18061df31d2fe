"""One gradient exchange per optimizer step under gradient accumulation (the [gradient_sync] section).

FSDP2's default reduce-scatters every micro-step's gradients (and, under HSDP, all-reduces them across replicas),
so gradient accumulation over k micro-steps moves k times the gradient bytes of one step. With ``once_per_step`` the
micro-steps before the last run with ``set_requires_gradient_sync(False)``: each FSDP module keeps its full
(unsharded) gradient and the next micro-step adds to it; the last micro-step reduce-scatters (and all-reduces across
replicas) the sum once. ``regather = keep`` also leaves the parameters gathered after a non-last backward
(``set_reshard_after_backward(False)``), so the next forward does not all-gather them again.

Memory, per rank: an unsharded gradient of every FSDP-managed parameter (the model's size / tp / pp in
gradient_sync.accumulate_dtype, parallel/fsdp.py ``accumulate_in``, instead of 1 / dp of it), plus, with ``keep``,
the unsharded parameters between micro-steps. ``auto`` takes it where that fits (parallel/accumulation.py).
Pipeline parallel: torch's schedule already skips the exchange between its own microbatches and reduces once per
schedule run (torch/distributed/pipelining/stage.py ``backward_maybe_with_nosync`` / ``perform_reduce_grad``); under
gradient accumulation the runs before the last skip that reduction, so it too happens once per optimizer step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.fsdp import FSDPModule

from meshforge.config.gradient_sync import GradientSync

if TYPE_CHECKING:
    from meshforge.parallel.pipeline.stage import Pipeline


def once_per_step(cfg: GradientSync, accumulation_steps: int) -> bool:
    """Whether the configuration lets the micro-steps before the last skip the gradient exchange: once_per_step, or
    auto under gradient accumulation (training decides auto by memory after its first step, train/grad_accum.py
    ``step_once``; the exact memory tool prices it as once per step, the larger peak)."""
    return not (accumulation_steps == 1 or cfg.mode == "every_microstep")


def keep_gathered(cfg: GradientSync) -> bool:
    """Whether the user asked parameters to stay gathered between micro-steps (auto: train/regather.py decides)."""
    return cfg.regather == "keep"


def set_micro_step(model_parts: list[nn.Module], *, last: bool, keep: bool, pipeline: Pipeline | None = None) -> None:
    """Before a micro-step's backward: exchange gradients only when ``last``; with ``keep`` also reshard only then.
    Every FSDP module of the parts (nested ones included: transformer blocks, routed experts). A pipeline's schedule
    sets its stages' FSDP flags per microbatch itself: there only its closing reduction is skipped before the last
    micro-step (parallel/pipeline/stage.py ``deferred_reduction``; the stages stay gathered in between)."""
    if pipeline is not None:
        pipeline.reduce_grads = last
        return
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(last, recurse=False)
                if keep:
                    module.set_reshard_after_backward(last, recurse=False)
