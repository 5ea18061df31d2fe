"""training.loss_chunks on FSDP 2, FSDP 2 x TP 2 (loss parallel: vocab-sharded chunk logits, the parallel
cross-entropy), PP 2 and PP 2 x TP 2 (the last stage's forward returns the chunked loss): the same losses and grad
norms as the full-logits loss on the same layout within 1e-6 (fp32, same seed), and the single process's within the
parity tolerance."""

from __future__ import annotations

import pytest
from launcher import run_ranks
from parity import Trace, assert_parity, reference, train_records

pytestmark = pytest.mark.distributed

STEPS = ["--training.steps", "3"]


def assert_chunked_matches_unchunked(world: int, layout: list[str], chunks: int = 5) -> None:
    want = Trace(run_ranks(train_records, world, [*STEPS, *layout])[0])
    got = Trace(run_ranks(train_records, world, [*STEPS, *layout, "--training.loss_chunks", str(chunks)])[0])
    for w, g, wn, gn in zip(want, got, want.grad_norms, got.grad_norms, strict=True):
        assert abs(g - w) <= 1e-6, (g, w)
        assert abs(gn - wn) <= 1e-6, (gn, wn)
    assert_parity(got, reference(tuple(STEPS)))


def test_fsdp2_chunked_loss_matches_unchunked() -> None:
    assert_chunked_matches_unchunked(2, ["--training.local_batch_size", "4"])


def test_fsdp2_tp2_loss_parallel_chunked_loss_matches_unchunked() -> None:
    layout = ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]
    assert_chunked_matches_unchunked(4, layout)


def test_pp2_chunked_loss_matches_unchunked() -> None:
    layout = ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]
    assert_chunked_matches_unchunked(2, layout, chunks=3)


def test_pp2_tp2_loss_parallel_chunked_loss_matches_unchunked() -> None:
    """The last stage's logits chunked under loss parallel: vocab-sharded chunk logits on the last pipeline stage."""
    layout = ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]
    assert_chunked_matches_unchunked(4, [*layout, "--parallelism.tensor_parallel_degree", "2"], chunks=3)
