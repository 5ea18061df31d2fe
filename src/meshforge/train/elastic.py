"""Elastic resume: a checkpoint taken under N data-parallel ranks continues under fewer (a lost node) with the same
global batch, by raising gradient accumulation; and saves bounded by wall time (``checkpoint.interval_seconds``).

The global batch (sequences per optimizer step) is written into each checkpoint's manifest (``global_batch``). On a
resume whose layout gives another global batch, ``training.gradient_accumulation_steps`` becomes
saved / (dp x local batch) when that divides, and one line says so; the data loader continues from its saved global
position (each micro-step takes the next dp x local batch samples), so a step trains the same samples as before.

The wall-time save decision must be the same on every rank (clocks differ; a save is collective). Rank 0 decides,
and its decision rides on the straggler gather of log steps (observability/straggler.py): no collective of its own
and none on other steps, at the price of a save up to ``metrics.log_freq`` steps after the interval has passed.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from meshforge.config.schema import JobConfig
from meshforge.errors import ConfigError
from meshforge.parallel.dims import ParallelDims

MANIFEST_KEY = "global_batch"


def global_batch(cfg: JobConfig, dims: ParallelDims) -> int:
    """Sequences per optimizer step: dp degree x local batch x gradient accumulation."""
    return dims.dp * cfg.training.local_batch_size * cfg.training.gradient_accumulation_steps


def saved_global_batch(cfg: JobConfig, step: int) -> int | None:
    """The global batch the checkpoint of ``step`` was trained with (None: an older checkpoint without it)."""
    from meshforge.checkpoint import store  # DCP imports ~0.3 s: only runs that resume pay it

    manifest = store.read_manifest(store.step_dir(Path(cfg.job.dump_folder) / cfg.checkpoint.folder, step))
    value = (manifest or {}).get(MANIFEST_KEY)
    return int(value) if value is not None else None


def keep_global_batch(cfg: JobConfig, dims: ParallelDims, saved: int | None, console: bool) -> JobConfig:
    """``cfg`` with gradient accumulation raised (or lowered) so the global batch equals ``saved``; unchanged when
    it already does, when nothing was saved, or when ``checkpoint.keep_global_batch`` is off."""
    now = global_batch(cfg, dims)
    if saved is None or saved == now or not cfg.checkpoint.keep_global_batch:
        return cfg
    per_micro = dims.dp * cfg.training.local_batch_size
    if saved % per_micro:
        raise ConfigError(
            f"training.local_batch_size = {cfg.training.local_batch_size}: the checkpoint's global batch of {saved} "
            f"sequences is not a multiple of dp {dims.dp} x local batch; pick a local batch that divides "
            f"{saved // dims.dp if saved % dims.dp == 0 else saved}, or set checkpoint.keep_global_batch = false"
        )
    accum = saved // per_micro
    if console:
        print(
            f"meshforge: elastic resume: the checkpoint's global batch is {saved} sequences; with dp {dims.dp} x local "
            f"batch {cfg.training.local_batch_size}, training.gradient_accumulation_steps "
            f"{cfg.training.gradient_accumulation_steps} -> {accum} keeps it",
            file=sys.stdout,
            flush=True,
        )
    training = dataclasses.replace(cfg.training, gradient_accumulation_steps=accum)
    return dataclasses.replace(cfg, training=training)


class SaveClock:
    """Rank 0's wall-time save decision: due when ``seconds`` (> 0) have passed since the last save."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last = time.monotonic()

    def flag(self) -> float:
        """1.0 when a save is due by wall time, else 0.0 (only rank 0's value is used)."""
        return float(self.seconds > 0 and time.monotonic() - self.last >= self.seconds)

    def after(self, step: int, interval: int, forced: bool) -> None:
        """Restart the clock when ``step`` saved (forced, or on the step interval)."""
        if forced or step % interval == 0:
            self.last = time.monotonic()
