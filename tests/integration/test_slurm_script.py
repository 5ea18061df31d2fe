"""The SLURM example checked the way it runs: scripts/slurm_bench.sh prints each node's command (PRINT_COMMANDS=1),
and the test runs both as two local "nodes" (1 rank each, c10d rendezvous on 127.0.0.1): the 2-rank run of a tiny
matrix spans both nodes and node 0 writes its result. Two repetitions (not the default 3): the nodes meet again under
the run's one rendezvous id and must agree on the repetitions; a third adds nothing to that."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import free_port

from meshforge.paths import REPO_ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MATRIX = """
[bench]
name = "two-nodes"
flavor = "tiny"
seq_len = 64
global_batch_size = 4
warmup_steps = 1
measured_steps = 1
repeat = 2
timeout_s = 240
baseline = "fsdp"

[bench.overrides]
"training.deterministic" = true

[[run]]
name = "fsdp"
ranks = 2
"""


def test_printed_commands_run_as_two_local_nodes(tmp_path: Path) -> None:
    matrix, out = tmp_path / "matrix.toml", tmp_path / "out"
    matrix.write_text(MATRIX)
    env = {**os.environ, "PRINT_COMMANDS": "1", "SLURM_NNODES": "2", "HEAD": "127.0.0.1", "GPUS_PER_NODE": "1"}
    env.update(RDZV_PORT=str(free_port()), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    script = REPO_ROOT / "scripts/slurm_bench.sh"
    printed = subprocess.run(["bash", str(script), str(matrix), str(out)], env=env, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    commands = printed.stdout.strip().splitlines()
    assert len(commands) == 2 and "--node-rank 0" in commands[0] and "--node-rank 1" in commands[1]
    assert all(f"--rdzv-endpoint 127.0.0.1:{env['RDZV_PORT']}" in c for c in commands)
    nodes = [subprocess.Popen(["bash", "-c", c], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in commands]  # fmt: skip
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-2000:] for o in outputs)
    runs = {r["name"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert runs["fsdp"]["status"] == "ok", runs["fsdp"]["error"]
    assert runs["fsdp"]["world_size"] == 2 and runs["fsdp"]["final_loss"] > 0
    assert shlex.split(commands[0])[0] == "exec"
