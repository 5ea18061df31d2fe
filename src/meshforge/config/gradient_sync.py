"""The [gradient_sync] section: how often data-parallel gradients cross the network under gradient accumulation, in
its own module (schema.py is at its size limit). Applied by parallel/gradient_sync.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshforge.errors import ConfigError

MODES = ("auto", "every_microstep", "once_per_step")
REGATHER = ("auto", "reshard", "keep")
ACCUMULATE = ("float32", "bfloat16")


@dataclass
class GradientSync:
    """One gradient exchange per optimizer step, or one per micro-step."""

    mode: Literal["auto", "every_microstep", "once_per_step"] = "auto"
    """once_per_step: the micro-steps before the last accumulate full (unsharded) gradients locally, the last one
    reduce-scatters them (and all-reduces across HSDP replicas) once: 1 / gradient_accumulation_steps of the
    gradient traffic, for one unsharded gradient copy of the FSDP-sharded parameters in memory (in accumulate_dtype).
    every_microstep: FSDP's default (sharded gradients, one exchange per micro-step). auto, under
    training.gradient_accumulation_steps > 1: decided by memory, the rule the planner prices
    (parallel/accumulation.py): the first step exchanges every micro-step and is measured; from the second,
    once_per_step where that peak plus the unsharded gradients fits the device, else every_microstep
    (train/grad_accum.py). Pipeline parallel: the schedule runs before the last skip their closing reduction
    (torch's schedule already skips it between its own microbatches; auto takes it, at no memory cost)."""
    regather: Literal["auto", "reshard", "keep"] = "auto"
    """Under once_per_step, whether parameters stay gathered after a non-last micro-step's backward (keep: the next
    micro-step's forward all-gather is saved, for the unsharded parameters in memory until the step's last backward)
    or are freed (reshard: FSDP's default). auto: the first step reshards; from the second, keep where the reserved
    peak plus the gathered parameters (at the measured fragmentation) plus the memory outside the allocator (at least
    1.5 GiB: context, NCCL) fit the device on every rank, re-decided on each log step while kept (train/regather.py;
    a CPU: reshard)."""
    accumulate_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the unsharded gradients of micro-steps (or pipeline microbatches) that skip the exchange are summed
    in, whatever training.mixed_precision_reduce is: float32 (bf16 gradients are up-cast as they arrive; with a
    bfloat16 reduce the sum is rounded to bf16 once, for the one exchange) or bfloat16 (half the memory, a bf16
    rounding per micro-step: NeMo's recipes' grad_sync_dtype bf16). Only with bf16 (or fp16) parameters: fp32
    parameters compute fp32 gradients and sum them in fp32 (parallel/fsdp.py ``accumulate_in``)."""

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"gradient_sync.mode = {self.mode!r}: use one of {', '.join(MODES)}")
        if self.regather not in REGATHER:
            raise ConfigError(f"gradient_sync.regather = {self.regather!r}: use one of {', '.join(REGATHER)}")
        if self.accumulate_dtype not in ACCUMULATE:
            raise ConfigError(
                f"gradient_sync.accumulate_dtype = {self.accumulate_dtype!r}: use one of {', '.join(ACCUMULATE)}"
            )
        if self.regather == "keep" and self.mode == "every_microstep":
            raise ConfigError(
                "gradient_sync.regather = 'keep' has no effect with gradient_sync.mode = 'every_microstep' (parameters "
                "are kept gathered only between micro-steps that skip the exchange): set gradient_sync.mode = "
                "'once_per_step' (or 'auto'), or drop regather"
            )
