"""training.loss_chunks under FSDP 2: the same losses and grad norms as the full-logits loss (fp32, same seed)."""

from __future__ import annotations

import pytest
from launcher import run_ranks
from parity import train_records

pytestmark = pytest.mark.distributed


def test_fsdp2_chunked_loss_matches_unchunked() -> None:
    base = ["--training.local_batch_size", "4", "--training.steps", "3"]
    want = run_ranks(train_records, 2, base)[0]
    got = run_ranks(train_records, 2, [*base, "--training.loss_chunks", "5"])[0]
    for w, g in zip(want, got, strict=True):
        assert abs(g["loss"] - w["loss"]) <= 1e-6, (g["loss"], w["loss"])
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-6, (g["grad_norm"], w["grad_norm"])
