"""Exact resume (bitwise, fp32 deterministic): 20 steps == 10 steps + resume + 10 steps; and a process killed while
it saves resumes from the previous complete checkpoint, never from the incomplete one."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest
from launcher import run_ranks
from parity import BASE

pytestmark = pytest.mark.distributed


def train_losses(dump: str, overrides: list[str], stop_at: int = 0) -> dict[int, float]:
    """Runs inside a rank: train, stopping after step ``stop_at`` when set (its checkpoint is then written)."""
    from meshforge.config.io import load_config
    from meshforge.train.loop import run_steps, setup

    state = setup(load_config(None, [*BASE, "--job.dump_folder", dump, *overrides]))
    losses = {}
    for record in run_steps(state):
        losses[record["step"]] = record["loss"]
        if record["step"] == stop_at:
            break
    if state.checkpointer is not None:
        state.checkpointer.close()
    return losses


def test_fsdp2_async_resume_is_bitwise_exact() -> None:
    args = ["--training.steps", "20", "--training.local_batch_size", "4"]
    whole = run_ranks(train_losses, 2, tempfile.mkdtemp(), args)[0]
    ckpt = [*args, "--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.async_mode", "async"]
    dump = tempfile.mkdtemp()
    first = run_ranks(train_losses, 2, dump, ckpt, 10)[0]
    assert (Path(dump) / "checkpoint/step-10/meshforge.json").is_file()
    second = run_ranks(train_losses, 2, dump, ckpt)[0]
    assert sorted(first) == list(range(1, 11)) and sorted(second) == list(range(11, 21))
    assert {**first, **second} == whole  # bitwise


def train_then_die_in_commit(dump: str, overrides: list[str], die_at: int) -> None:
    """A single process that is SIGKILLed while saving step ``die_at``: after DCP wrote every file, before the
    checkpoint is committed (the widest window a real crash can hit)."""
    from meshforge.checkpoint import store as checkpoint_store

    commit = checkpoint_store.commit

    def commit_or_die(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
        if manifest["step"] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        commit(tmp, final, manifest)

    checkpoint_store.commit = commit_or_die
    train_losses(dump, overrides)


def test_killed_while_saving_resumes_from_the_previous_checkpoint() -> None:
    dump = tempfile.mkdtemp()
    args = ["--training.steps", "6", "--training.local_batch_size", "8", "--checkpoint.enable"]
    args += ["--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]
    proc = mp.get_context("fork").Process(target=train_then_die_in_commit, args=(dump, args, 4))
    proc.start()
    proc.join(timeout=240)
    assert proc.exitcode == -signal.SIGKILL
    folder = Path(dump) / "checkpoint"
    assert (folder / "step-2/meshforge.json").is_file() and (folder / "step-4.tmp/.metadata").is_file()
    assert not (folder / "step-4").exists()
    before = {r["step"]: r["loss"] for r in map(json.loads, (Path(dump) / "metrics.jsonl").read_text().splitlines())}
    assert sorted(before) == [1, 2, 3]  # step 4 trained, then died saving before it logged
    after = run_ranks(train_losses, 1, dump, args)[0]
    assert sorted(after) == [3, 4, 5, 6]  # resumed from step-2
    assert after[3] == before[3]
    assert not (folder / "step-4.tmp").exists() and (folder / "step-4/meshforge.json").is_file()
