"""Gradient accumulation averages its micro-steps (train/loop.py): in one process, 2 micro-steps of 4 sequences
give the losses and gradient norms of one step of 8 (fp32, deterministic). The 2-rank FSDP form is
tests/distributed/test_fsdp_parity.py::test_gradient_accumulation_matches_larger_batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from parity import BASE, GLOBAL_BATCH, assert_parity

from meshforge.config.io import load_config
from meshforge.train.loop import train

STEPS = ["--training.steps", "3"]


@pytest.fixture(autouse=True)
def _process_as_found() -> Iterator[None]:
    """training.deterministic switches torch's deterministic algorithms on process-wide: later tests get it back off."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _trace(dump: Path, batch: int, accum: int) -> tuple[list[float], list[float]]:
    overrides = ["--training.local_batch_size", str(batch), "--training.gradient_accumulation_steps", str(accum)]
    records = train(load_config(None, [*BASE, *STEPS, "--job.dump_folder", str(dump), *overrides]))
    return [r["loss"] for r in records], [float(r["grad_norm"]) for r in records]


def test_two_micro_steps_average_to_the_larger_batch(tmp_path: Path) -> None:
    losses, norms = _trace(tmp_path / "accum", GLOBAL_BATCH // 2, 2)
    want_losses, want_norms = _trace(tmp_path / "whole", GLOBAL_BATCH, 1)
    assert_parity(losses, want_losses)
    for step, (g, w) in enumerate(zip(norms, want_norms, strict=True), start=1):
        assert abs(g - w) <= 1e-6 * w, f"step {step}: grad norm {g} vs {w} of one larger batch (summed, not averaged?)"
