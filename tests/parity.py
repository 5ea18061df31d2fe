"""Loss parity against a single process: same seed, same global batch, fp32, deterministic."""

from __future__ import annotations

import functools
import tempfile
from typing import Any

from launcher import run_ranks

GLOBAL_BATCH = 8
BASE = [
    "--model.flavor",
    "tiny",
    "--training.seq_len",
    "64",
    "--training.steps",
    "5",
    "--training.deterministic",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    "--activation_checkpoint.mode",
    "none",
    "--optimizer.lr",
    "3e-3",
]


def train_records(overrides: list[str]) -> list[dict[str, Any]]:
    """Runs inside a rank: train with BASE + overrides, return the logged records."""
    from meshforge.config.io import load_config
    from meshforge.train.loop import train

    dump = tempfile.mkdtemp(prefix="meshforge-test-")
    return train(load_config(None, [*BASE, "--job.dump_folder", dump, *overrides]))


class Trace(list[float]):
    """A run's losses per step (a list, as before) with its gradient norms per step beside them."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        super().__init__(r["loss"] for r in records)
        self.grad_norms = [float(r["grad_norm"]) for r in records]


def losses(world_size: int, overrides: list[str], rank: int = 0) -> Trace:
    """Rank ``rank``'s losses (and grad norms) of a run of BASE + ``overrides`` on ``world_size`` forked ranks."""
    return Trace(run_ranks(train_records, world_size, overrides)[rank])


@functools.cache
def reference(extra: tuple[str, ...] = ()) -> Trace:
    """The single-process losses and grad norms for the global batch (cached per extra overrides)."""
    return losses(1, ["--training.local_batch_size", str(GLOBAL_BATCH), *extra])


GRAD_NORM_RTOL = {1e-5: 1e-6, 2e-3: 1e-2}
"""Gradient-norm tolerance for each loss tolerance (fp32 1e-5, bf16 2e-3). Measured (tiny, 5 steps, vs the single
process; under load, 2026-12-01): fp32 FSDP 2 / TP 2 / CP 2 / PP 2 grad norms agree to <= 8.9e-9 relative (losses
2.4e-7): 1e-6 leaves 100x; bf16 CP 2 to 1.8e-3 (losses 4.2e-4): 1e-2 leaves 5x. Another loss tolerance compares
grad norms only when ``grad_rtol`` is given."""


def assert_parity(got: list[float], want: list[float], rtol: float = 1e-5, grad_rtol: float | None = None) -> None:
    """Losses agree to ``rtol`` at every step; so do the gradient norms (to ``grad_rtol``, default
    GRAD_NORM_RTOL[rtol]) when both are Traces. The grad norm catches what Adam hides in the loss (a gradient
    scaled by a constant, e.g. the expert-parallel scale)."""
    assert len(got) == len(want), (got, want)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert abs(g - w) <= rtol * abs(w), f"step {step}: {g} vs single process {w} (rtol {rtol})\n{got}\n{want}"
    tol = grad_rtol if grad_rtol is not None else GRAD_NORM_RTOL.get(rtol)
    if isinstance(got, Trace) and isinstance(want, Trace) and tol is not None:
        for step, (g, w) in enumerate(zip(got.grad_norms, want.grad_norms, strict=True), start=1):
            assert abs(g - w) <= tol * abs(w), (
                f"step {step}: grad norm {g} vs single process {w} (rtol {tol})\n{got.grad_norms}\n{want.grad_norms}"
            )
