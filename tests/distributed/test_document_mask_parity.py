"""Document masking through the training loop: PP 2 (positions travel through the schedule) and TP 2 (the mask goes
past the attention input plan) give the losses of one process with masking, which differ from unmasked losses."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from launcher import run_ranks
from parity import GLOBAL_BATCH, Trace, assert_parity, train_records

pytestmark = pytest.mark.distributed

STEPS = ["--training.steps", "2", "--validation.enable", "--validation.freq", "1", "--validation.steps", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Many short documents (several per 64-token window), prepared into a private cache."""
    folder = tmp_path_factory.mktemp("docs")
    rng = random.Random(0)
    words = [
        "the",
        "of",
        "and",
        "to",
        "her",
        "she",
        "was",
        "it",
        "in",
        "that",
        "not",
        "be",
        "Emma",
        "Anne",
        "Elinor",
        "said",
        "could",
        "would",
    ]
    for i in range(80):
        (folder / f"d{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))))
    (folder / "val").mkdir()
    for i in range(6):
        (folder / "val" / f"v{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))))
    return ["--training.dataset", "text", "--training.dataset_path", str(folder), *STEPS]


def run(world: int, args: list[str], cache: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, float]]:
    monkeypatch.setenv("MESHFORGE_CACHE", str(cache))
    return run_ranks(train_records, world, args)[0]


def test_document_mask_pp2_tp2_match_single_process(
    corpus: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    masked = [*corpus, "--training.document_mask"]
    single = run(1, [*masked, "--training.local_batch_size", str(GLOBAL_BATCH)], tmp_path, monkeypatch)
    plain = run(1, [*corpus, "--training.local_batch_size", str(GLOBAL_BATCH)], tmp_path, monkeypatch)
    assert abs(single[1]["loss"] - plain[1]["loss"]) > 1e-4  # the mask changes the numbers
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    for layout in (pp, tp):
        got = run(2, [*masked, *layout, "--training.local_batch_size", str(GLOBAL_BATCH)], tmp_path, monkeypatch)
        assert_parity(Trace(got), Trace(single))  # losses and grad norms
        assert_parity([r["val_loss"] for r in got], [r["val_loss"] for r in single])
