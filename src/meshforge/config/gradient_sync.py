"""The [gradient_sync] section: how often data-parallel gradients cross the network under gradient accumulation, in
its own module (schema.py is at its size limit). Applied by parallel/gradient_sync.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshforge.errors import ConfigError

MODES = ("auto", "every_microstep", "once_per_step")
REGATHER = ("auto", "reshard", "keep")


@dataclass
class GradientSync:
    """One gradient exchange per optimizer step, or one per micro-step."""

    mode: Literal["auto", "every_microstep", "once_per_step"] = "auto"
    """once_per_step: the micro-steps before the last accumulate full (unsharded) gradients locally, the last one
    reduce-scatters them (and all-reduces across HSDP replicas) once: 1 / gradient_accumulation_steps of the
    gradient traffic, for one unsharded gradient copy of the FSDP-sharded parameters in memory. every_microstep:
    FSDP's default (sharded gradients, one exchange per micro-step). auto: once_per_step when
    training.gradient_accumulation_steps > 1. Pipeline parallel: the schedule runs before the last skip their
    closing reduction (torch's schedule already skips it between its own microbatches)."""
    regather: Literal["auto", "reshard", "keep"] = "auto"
    """Under once_per_step, whether parameters stay gathered after a non-last micro-step's backward (keep: the next
    micro-step's forward all-gather is saved, for the unsharded parameters in memory until the step's last backward)
    or are freed (reshard: FSDP's default). auto: the first step reshards; from the second, keep where the reserved
    peak plus the gathered parameters (at the measured fragmentation) plus the memory outside the allocator (at least
    1.5 GiB: context, NCCL) fit the device on every rank, re-decided on each log step while kept (train/regather.py;
    a CPU: reshard)."""

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"gradient_sync.mode = {self.mode!r}: use one of {', '.join(MODES)}")
        if self.regather not in REGATHER:
            raise ConfigError(f"gradient_sync.regather = {self.regather!r}: use one of {', '.join(REGATHER)}")
        if self.regather == "keep" and self.mode == "every_microstep":
            raise ConfigError(
                "gradient_sync.regather = 'keep' has no effect with gradient_sync.mode = 'every_microstep' (parameters "
                "are kept gathered only between micro-steps that skip the exchange): set gradient_sync.mode = "
                "'once_per_step' (or 'auto'), or drop regather"
            )
