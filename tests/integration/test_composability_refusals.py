"""Every *refused* cell of the composability table fails a user's first try before step 1: ``meshforge train
--dry-run`` exits 2 with one line (in this process for every cell, from the shell for one; the training runs of the
refused cells are in tests/distributed/test_composability_matrix.py)."""

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
        for name in table.SCHEDULES
    },
    **{
        f"cp_{impl}": ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_impl", impl]
        for impl in ("allgather", "ring")
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
    "tied_embeddings": ["--model.tie_embeddings", "true", "--activation_checkpoint.mode", "none"],
    "document_mask": ["--training.document_mask"],
}
REFUSED = sorted(key for key, c in table.CELLS.items() if c.status == "refused")


def test_every_refused_cell_has_a_command() -> None:
    assert REFUSED and all(p in ROWS and f in COLUMNS for p, f in REFUSED)


def args_of(parallelism: str, feature: str) -> list[str]:
    return ["train", "--dry-run", "--world-size", "2", *ROWS[parallelism], *COLUMNS[feature]]


@pytest.mark.parametrize(("parallelism", "feature"), REFUSED)
def test_refused_cell_exits_2_with_one_line_before_step_1(
    parallelism: str, feature: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshforge.cli import main

    assert main(args_of(parallelism, feature)) == 2  # the CLI's own entry point, in this process
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0], err[-2000:]
    assert "step " not in out


def test_a_refused_cell_from_the_shell_exits_2_with_one_line() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "meshforge", *args_of(*REFUSED[0])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0], proc.stderr[-2000:]
    assert "step " not in proc.stdout
