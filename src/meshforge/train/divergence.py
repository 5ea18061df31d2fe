"""Stop (or skip) on a non-finite loss or gradient norm, without the host waiting for the device inside a step.

The signal is the global gradient norm that clipping computes anyway: it is reduced over every shard and pipeline
stage, so every rank sees the same value and takes the same decision with no extra collective (a NaN or Inf loss on
any rank makes its gradients, and so the global norm, non-finite). The decision stays on the device: ``skip_flag``
returns a device flag, 1 for a non-finite step or once the run is past its budget of skipped steps, that the fused
optimizer honours as AMP's ``found_inf`` (train/optim.py ``step_unless``: the update, the moments and the step count
stay as they were). The host reads the pending steps' norms once, on log steps and before a checkpoint save
(``check``): it prints the skipped steps and raises `TrainingDiverged` naming the first step past the budget. A run
past its budget updates nothing from that step on, so when it stops (at the latest on the next log step) its weights,
optimizer state and checkpoints are those of the last good step, as when the read was made every step.
"""

from __future__ import annotations

import math

import torch

from meshforge.parallel.local_ranks import rank_zero

EXIT_CODE = 4  # distinct from 1 (a crash), 2 (a configuration mistake) and 3 (a collective failure)


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm, past the allowed number of skipped steps."""


class NonFiniteGuard:
    """Decides after the gradients of a step are reduced: finite -> update; non-finite -> skip the update while
    fewer than ``max_skips`` steps were skipped in this run, else stop the run (raised by ``check``)."""

    def __init__(self, max_skips: int = 0, console: bool = False) -> None:
        self.max_skips, self.console = max_skips, console
        self.skipped: list[int] = []
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, norm, local loss) not yet read
        self.bad: torch.Tensor | None = None  # non-finite steps so far, on the device

    def skip_flag(self, step: int, grad_norm: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """A float32 device flag, 1.0 when this step must update nothing (non-finite, or past the budget); no read."""
        nonfinite = ~torch.isfinite(grad_norm.detach())
        self.bad = nonfinite.to(torch.int32) if self.bad is None else self.bad + nonfinite
        self.pending.append((step, grad_norm.detach(), loss.detach()))
        return (nonfinite | (self.bad > self.max_skips)).to(torch.float32)

    def check(self) -> None:
        """Read the pending steps (one host read of their norms, one of their losses): print each skipped step and
        raise `TrainingDiverged` at the first non-finite step past the budget. Called on log and save steps."""
        if not self.pending:
            return
        steps = [s for s, _, _ in self.pending]
        norms = torch.stack([n.double() for _, n, _ in self.pending]).tolist()
        losses = torch.stack([rank_zero(loss).double() for _, _, loss in self.pending]).tolist()  # --local-ranks
        self.pending = []
        for step, norm, local in zip(steps, norms, losses, strict=True):
            if math.isfinite(norm):
                continue
            what = f"gradient norm {norm}" + (f", loss {local} on this rank" if not math.isfinite(local) else "")
            if len(self.skipped) < self.max_skips:
                self.skipped.append(step)
                if self.console:
                    print(
                        f"meshforge: step {step}: non-finite {what}; update skipped "
                        f"({len(self.skipped)} of training.skip_nonfinite_steps = {self.max_skips})",
                        flush=True,
                    )
                continue
            skipped = f" after skipping steps {self.skipped}" if self.skipped else ""
            raise TrainingDiverged(f"training diverged at step {step}: non-finite {what}{skipped}")
