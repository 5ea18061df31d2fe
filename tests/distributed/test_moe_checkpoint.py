"""Checkpoints of an MoE model across expert-parallel degrees: saved under EP 2 at step 2, resumed under one process
(EP 1) to step 4, saved, resumed under EP 4 to step 6; every step's loss equals an uninterrupted single process (the
ep-sharded experts, their optimizer states and the expert biases travel with their global shapes)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from launcher import run_ranks
from parity import GLOBAL_BATCH, assert_parity
from test_checkpoint_reshard import train_tracked

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MOE = ["--model.flavor", "debugmoe", "--training.steps", "6"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]


def ep_layout(world: int) -> list[str]:
    return [
        "--training.local_batch_size",
        str(GLOBAL_BATCH // world),
        "--parallelism.expert_parallel_degree",
        str(world),
    ]


def continue_from(previous: Path, step: int, world: int, stop_at: int) -> tuple[Path, dict[str, Any]]:
    dump = Path(tempfile.mkdtemp(prefix="meshforge-moe-resume-"))
    shutil.copytree(previous / f"checkpoint/step-{step}", dump / f"checkpoint/step-{step}")
    result = run_ranks(train_tracked, world, str(dump), [*MOE, *CKPT, *ep_layout(world)], stop_at)[0]
    return dump, result


def test_resume_across_ep_degrees_2_1_4() -> None:
    ref = run_ranks(train_tracked, 1, tempfile.mkdtemp(), [*MOE, *ep_layout(1)])[0]["losses"]
    first = Path(tempfile.mkdtemp(prefix="meshforge-moe-ep2-"))
    got = run_ranks(train_tracked, 2, str(first), [*MOE, *CKPT, *ep_layout(2)], 2)[0]["losses"]
    assert sorted(got) == [1, 2]
    second, result = continue_from(first, 2, 1, 4)
    assert sorted(result["losses"]) == [3, 4]  # resumed, not restarted
    got.update(result["losses"])
    _, result = continue_from(second, 4, 4, 0)
    assert sorted(result["losses"]) == [5, 6]
    got.update(result["losses"])
    assert_parity([got[s] for s in range(1, 7)], [ref[s] for s in range(1, 7)])
