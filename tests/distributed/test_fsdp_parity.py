"""FSDP2 / HSDP layouts against one process on the same seed and global batch."""

from __future__ import annotations

import pytest
from parity import GLOBAL_BATCH, assert_parity, losses, reference

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_matches_single_process(world: int) -> None:
    got = losses(world, ["--training.local_batch_size", str(GLOBAL_BATCH // world)])
    assert_parity(got, reference())


def test_hsdp_2x2_matches_single_process() -> None:
    got = losses(
        4,
        [
            "--training.local_batch_size",
            "2",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
    )
    assert_parity(got, reference())


def test_gradient_accumulation_matches_larger_batch() -> None:
    got = losses(2, ["--training.local_batch_size", "2", "--training.gradient_accumulation_steps", "2"])
    assert_parity(got, reference())


def test_same_seed_same_layout_is_bitwise_identical() -> None:
    args = ["--training.local_batch_size", "4"]
    assert losses(2, args) == losses(2, args)
