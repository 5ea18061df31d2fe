"""Validation under FSDP 2, TP 2 and PP 2 equals the one-process evaluation of the same weights (same seed, same
global batch: the training parity keeps the weights equal, the validation loader gives every layout the same
held-out global batches)."""

from __future__ import annotations

import math

import pytest
from launcher import run_ranks
from parity import GLOBAL_BATCH, train_records

pytestmark = pytest.mark.distributed

VALIDATION = ["--training.steps", "2", "--validation.enable", "--validation.freq", "1", "--validation.steps", "2"]
LAYOUTS = {
    "fsdp2": ["--training.local_batch_size", str(GLOBAL_BATCH // 2)],
    "tp2": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", str(GLOBAL_BATCH)],
    "pp2": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
        "--training.local_batch_size",
        str(GLOBAL_BATCH),
    ],
}


def val_losses(world: int, overrides: list[str]) -> list[float]:
    records = run_ranks(train_records, world, [*VALIDATION, *overrides])[0]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) and r["val_time_s"] > 0
    return [r["val_loss"] for r in records]


@pytest.fixture(scope="module")
def single() -> list[float]:
    got = val_losses(1, ["--training.local_batch_size", str(GLOBAL_BATCH)])
    assert 5 < got[0] < 9 and got[1] < got[0]  # near log(vocab 2048) = 7.6 at the start, and learning
    return got


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_validation_matches_single_process(layout: str, single: list[float]) -> None:
    got = val_losses(2, LAYOUTS[layout])
    assert got == pytest.approx(single, rel=1e-5), (layout, got, single)
