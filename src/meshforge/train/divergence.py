"""Stop (or skip) on a non-finite loss or gradient norm.

The signal is the global gradient norm that clipping computes anyway: it is reduced over every shard and pipeline
stage, so every rank sees the same value and takes the same decision with no extra collective (a NaN or Inf loss on
any rank makes its gradients, and so the global norm, non-finite). Reading the scalar is one device-to-host copy per
step. A diverged step never reaches the optimizer or a checkpoint: the last committed checkpoint stays the last good
one.
"""

from __future__ import annotations

import math

import torch

EXIT_CODE = 4  # distinct from 1 (a crash), 2 (a configuration mistake) and 3 (a collective failure)


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm, past the allowed number of skipped steps."""


class NonFiniteGuard:
    """Decides after the gradients of a step are reduced: finite -> update; non-finite -> skip the update while
    fewer than ``max_skips`` steps were skipped in this run, else raise `TrainingDiverged` naming the step."""

    def __init__(self, max_skips: int = 0, console: bool = False) -> None:
        self.max_skips, self.console = max_skips, console
        self.skipped: list[int] = []

    def should_skip(self, step: int, grad_norm: torch.Tensor, loss: torch.Tensor) -> bool:
        """True when this step's update must be skipped; raises when the run must stop."""
        norm = float(grad_norm)
        if math.isfinite(norm):
            return False
        local = float(loss)
        what = f"gradient norm {norm}" + (f", loss {local} on this rank" if not math.isfinite(local) else "")
        if len(self.skipped) < self.max_skips:
            self.skipped.append(step)
            if self.console:
                print(
                    f"meshforge: step {step}: non-finite {what}; update skipped "
                    f"({len(self.skipped)} of training.skip_nonfinite_steps = {self.max_skips})",
                    flush=True,
                )
            return True
        skipped = f" after skipping steps {self.skipped}" if self.skipped else ""
        raise TrainingDiverged(f"training diverged at step {step}: non-finite {what}{skipped}")
