"""Extending a finished run: 4 steps, then the same command with ``--training.steps 8`` resumes from the last save
(a full checkpoint, with the model-only export beside it) and equals 8 straight steps bit for bit (losses and final
weights), under FSDP 2."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from launcher import run_ranks
from parity import BASE

pytestmark = pytest.mark.distributed

# a schedule that does not depend on training.steps: a decaying one is re-planned for the new total on extension
ARGS = ["--training.local_batch_size", "4", "--lr_scheduler.decay_type", "constant", "--checkpoint.enable"]
ARGS += ["--checkpoint.interval", "100"]


def train_run(dump: str, steps: int) -> tuple[dict[int, float], dict[str, np.ndarray]]:
    """Runs inside a rank: train to ``steps``; returns the losses and the full final weights (as numpy arrays:
    tensors would travel as shared-memory handles that die with the rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from meshforge.config.io import load_config
    from meshforge.train.loop import run_job, setup

    state = setup(load_config(None, [*BASE, *ARGS, "--job.dump_folder", dump, "--training.steps", str(steps)]))
    records = run_job(state)
    weights = get_model_state_dict(state.model_parts[0], options=StateDictOptions(full_state_dict=True))
    return {r["step"]: r["loss"] for r in records}, {k: v.detach().numpy().copy() for k, v in weights.items()}


def test_extending_a_finished_run_is_bitwise_the_straight_run() -> None:
    straight, straight_weights = run_ranks(train_run, 2, tempfile.mkdtemp(), 8)[0]
    dump = tempfile.mkdtemp()
    first, _ = run_ranks(train_run, 2, dump, 4)[0]
    folder = Path(dump) / "checkpoint"
    assert (folder / "step-4/meshforge.json").is_file() and (folder / "export/step-4/meshforge.json").is_file()
    second, weights = run_ranks(train_run, 2, dump, 8)[0]
    assert sorted(first) == list(range(1, 5)) and sorted(second) == list(range(5, 9))
    assert {**first, **second} == straight  # bitwise
    assert weights.keys() == straight_weights.keys()
    assert all(np.array_equal(weights[k], straight_weights[k]) for k in weights)
    assert (folder / "step-8/meshforge.json").is_file() and (folder / "export/step-8/meshforge.json").is_file()
