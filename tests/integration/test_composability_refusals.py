"""Every *refused* cell of the composability table fails a user's first try before step 1: ``meshforge train
--dry-run`` exits 2 with one line (the start of the covering-array matrix test, issue 28)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from meshforge.parallel import composability as table

ROWS = {
    "ep": ["--model.flavor", "debugmoe", "--parallelism.expert_parallel_degree", "2"],
    **{
        f"pp_{name}": [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            name,
            "--training.local_batch_size",
            "8",
        ]
        for name in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    },
}
COLUMNS = {
    "compile": ["--compile.enable"],
    "ac_selective_op": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
}
REFUSED = sorted(key for key, c in table.CELLS.items() if c.status == "refused")


def test_every_refused_cell_has_a_command() -> None:
    assert REFUSED and all(p in ROWS and f in COLUMNS for p, f in REFUSED)


@pytest.mark.parametrize(("parallelism", "feature"), REFUSED)
def test_refused_cell_exits_2_with_one_line_before_step_1(parallelism: str, feature: str) -> None:
    args = ["train", "--dry-run", "--world-size", "2", *ROWS[parallelism], *COLUMNS[feature]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "meshforge", *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0], proc.stderr[-2000:]
    assert "step " not in proc.stdout
