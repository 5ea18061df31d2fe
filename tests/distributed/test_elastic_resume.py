"""Elastic resume (train/elastic.py): a checkpoint taken under FSDP 4 at step 10 relaunches under FSDP 2 with the same
local batch; gradient accumulation goes 1 -> 2 by itself so the global batch stays 8, each of steps 11-20 trains the
same samples as an uninterrupted run, and the losses agree within fp32 reduction-order noise. checkpoint
.interval_seconds saves on the log steps after the wall-time interval, on every rank alike."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from launcher import run_ranks
from parity import BASE, GLOBAL_BATCH, assert_parity

pytestmark = pytest.mark.distributed

STEPS, SAVE_AT, LOCAL = 20, 10, 2
CKPT = ["--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", str(SAVE_AT)]
CKPT += ["--checkpoint.last_save_model_only", "false"]


def tracked(dump: str, overrides: list[str], stop_at: int = 0) -> dict[str, Any]:
    """Runs inside a rank: train, recording each step's loss and every sample id of every micro-step."""
    from meshforge.config.io import load_config
    from meshforge.train.loop import run_steps, setup

    state = setup(load_config(None, [*BASE, "--job.dump_folder", dump, *overrides]))
    seen: dict[int, list[int]] = {}
    real = state.loader.next_batch

    def next_batch() -> Any:
        batch = real()
        seen.setdefault(state.step, []).extend(state.loader.sample_ids())
        return batch

    state.loader.next_batch = next_batch  # type: ignore[method-assign]
    losses = {}
    for record in run_steps(state):
        losses[record["step"]] = record["loss"]
        if record["step"] == stop_at:
            break
    if state.checkpointer is not None:
        state.checkpointer.close()
    return {"losses": losses, "seen": seen, "accum": state.cfg.training.gradient_accumulation_steps}


def per_step(results: list[dict[str, Any]]) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for rank in results:
        for step, ids in rank["seen"].items():
            steps.setdefault(step, []).extend(ids)
    return {step: sorted(ids) for step, ids in steps.items()}


def test_fsdp4_checkpoint_resumes_under_fsdp2_with_the_global_batch() -> None:
    reference = run_ranks(
        tracked,
        1,
        tempfile.mkdtemp(prefix="meshforge-ref-"),
        ["--training.steps", str(STEPS), "--training.local_batch_size", str(GLOBAL_BATCH)],
    )
    saved = Path(tempfile.mkdtemp(prefix="meshforge-el4-"))
    before = run_ranks(tracked, 4, str(saved), [*CKPT, "--training.local_batch_size", str(LOCAL)], SAVE_AT)
    dump = Path(tempfile.mkdtemp(prefix="meshforge-el2-"))
    shutil.copytree(saved / "checkpoint" / f"step-{SAVE_AT}", dump / "checkpoint" / f"step-{SAVE_AT}")
    after = run_ranks(tracked, 2, str(dump), [*CKPT, "--training.local_batch_size", str(LOCAL)])
    assert [r["accum"] for r in before] == [1] * 4 and [r["accum"] for r in after] == [2, 2]
    want = per_step(reference)
    got = per_step(before) | per_step(after)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == want  # every step the same samples: none repeated, none skipped
    losses = before[0]["losses"] | after[0]["losses"]
    assert_parity([losses[s] for s in range(1, STEPS + 1)], [reference[0]["losses"][s] for s in range(1, STEPS + 1)])


def test_interval_seconds_saves_on_the_log_steps_after_the_interval() -> None:
    dump = Path(tempfile.mkdtemp(prefix="meshforge-elsec-"))
    run_ranks(
        tracked,
        2,
        str(dump),
        [
            "--training.steps",
            "5",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "1000",
            "--checkpoint.interval_seconds",
            "0.001",
            "--metrics.log_freq",
            "2",
            "--checkpoint.last_save_model_only",
            "false",
            "--training.local_batch_size",
            str(LOCAL),
        ],
    )
    steps = sorted(int(p.name.removeprefix("step-")) for p in (dump / "checkpoint").glob("step-*"))
    assert steps == [1, 2, 4, 5], steps  # log steps 1, 2, 4 by wall time; 5 is the last step
