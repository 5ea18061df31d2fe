"""Divergence: a NaN loss on one rank stops every rank at that step (no hang, no update, no checkpoint of the bad
state), naming the step and the last good checkpoint; with training.skip_nonfinite_steps the update is skipped instead;
the CLI exits 4 with one line."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from launcher import run_ranks
from parity import BASE

pytestmark = pytest.mark.distributed


def poisoned_run(dump: str, overrides: list[str], bad: dict[int, int]) -> dict[str, Any]:
    """Runs inside a rank: train with the loss replaced by NaN at the steps of ``bad`` (step -> rank); returns the
    logged records, the error (if any) and the optimizer's step count."""
    import torch
    import torch.distributed as dist

    from meshforge.config.io import load_config
    from meshforge.train import loop
    from meshforge.train.divergence import TrainingDiverged

    state = loop.setup(load_config(None, [*BASE, "--job.dump_folder", dump, *overrides]))
    rank = dist.get_rank() if dist.is_initialized() else 0
    real = loop.cross_entropy

    def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = real(logits, labels)
        return loss * float("nan") if bad.get(state.step) == rank else loss

    loop.cross_entropy = cross_entropy  # type: ignore[assignment]
    out: dict[str, Any] = {"error": None}
    try:
        out["records"] = loop.run_job(state)
    except TrainingDiverged as exc:
        out["error"] = str(exc)
    finally:
        loop.cross_entropy = real  # type: ignore[assignment]
    out["adam_steps"] = {int(s["step"]) for s in state.optimizer.state.values()}
    out["step"] = state.step
    return out


def test_nan_on_one_rank_stops_every_rank_and_keeps_the_last_good_checkpoint() -> None:
    dump = tempfile.mkdtemp()
    args = ["--training.steps", "8", "--training.local_batch_size", "4", "--checkpoint.enable"]
    args += ["--checkpoint.interval", "2"]
    results = run_ranks(poisoned_run, 2, dump, args, {5: 1})
    folder = Path(dump) / "checkpoint"
    for out in results:  # both ranks stop at step 5, before its update
        assert out["error"].startswith("training diverged at step 5: non-finite gradient norm nan")
        assert f"the last good checkpoint is {folder / 'step-4'}" in out["error"]
        assert out["step"] == 5 and out["adam_steps"] == {4}
    assert "norm nan, loss nan on this rank;" in results[1]["error"] and "norm nan;" in results[0]["error"]
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4"]


def test_skip_nonfinite_steps_skips_the_update_up_to_the_budget() -> None:
    args = ["--training.steps", "6", "--training.local_batch_size", "4", "--training.skip_nonfinite_steps", "1"]
    out = run_ranks(poisoned_run, 1, tempfile.mkdtemp(), args, {3: 0})[0]
    assert out["error"] is None and out["step"] == 6 and out["adam_steps"] == {5}  # 6 steps, one update skipped
    losses = {r["step"]: r["loss"] for r in out["records"]}
    assert losses[3] != losses[3] and all(losses[s] == losses[s] for s in (1, 2, 4, 5, 6))  # NaN only at step 3
    out = run_ranks(poisoned_run, 1, tempfile.mkdtemp(), args, {3: 0, 5: 0})[0]
    want = "training diverged at step 5: non-finite gradient norm nan, loss nan on this rank after skipping steps [3]"
    assert out["error"] == want and out["adam_steps"] == {3}


def test_cli_exits_4_with_one_line_on_divergence() -> None:
    dump = tempfile.mkdtemp()
    cmd = [sys.executable, "-m", "meshforge", "train", *BASE, "--job.dump_folder", dump, "--optimizer.lr", "1e30"]
    cmd += ["--training.steps", "6", "--metrics.progress_bar", "false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 4, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("meshforge train: error: training diverged at step ")
    assert "Traceback" not in proc.stderr


def test_a_divergence_between_log_steps_stops_at_the_next_one_with_nothing_updated_since() -> None:
    """The guard decides on the device and reads on log steps: a NaN at step 4 (log_freq 3: steps 3, 6 log) stops the
    run at step 6 naming step 4, and steps 4-6 updated nothing (Adam's step count is 3 on every parameter)."""
    args = ["--training.steps", "8", "--training.local_batch_size", "4", "--metrics.log_freq", "3"]
    out = run_ranks(poisoned_run, 1, tempfile.mkdtemp(), args, {4: 0})[0]
    assert out["error"] == "training diverged at step 4: non-finite gradient norm nan, loss nan on this rank"
    assert out["step"] == 6 and out["adam_steps"] == {3}
