"""torchft replica groups with a pipeline or a MoE model inside (train/fault_tolerance.py): 2 groups x 2 ranks, group 1
joins while group 0 is already training, so it is live-recovered from its peer: rank r of group 1 (a pipeline stage,
or an FSDP shard of a MoE model) receives the state of rank r of group 0, which holds the same stage / shard. From
its first step on, both groups hold bit-identical parameters and (MoE) expert biases at every step: the expert loads
are summed over the groups too, as HSDP sums them over all its data-parallel ranks, and the biases travel with the
recovered state."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_fault_tolerance import kill_tree, steps, wait_for_step

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
torchft = pytest.importorskip("torchft", reason="needs torchft: pip install 'meshforge[ft]'")

COMMON = [
    "--training.steps", "400", "--training.deterministic", "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1", "--activation_checkpoint.mode", "none", "--metrics.straggler_threshold", "0",
    "--comm.train_timeout_seconds", "60", "--fault_tolerance.start_together", "false",
    "--fault_tolerance.params_digest",
]  # fmt: skip
CASES = {
    "pp": ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.local_batch_size", "4",
           "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
           "--parallelism.pipeline_parallel_microbatch_size", "2"],
    "moe": ["--model.flavor", "debugmoe", "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--parallelism.data_parallel_shard_degree", "2"],
}  # fmt: skip
JOINT_STEPS = 4


def launch(case: str, group: int, dump: Path, lighthouse: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", "2", *COMMON, *CASES[case]]
    cmd += ["--job.dump_folder", str(dump), "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(group)]
    cmd += ["--fault_tolerance.group_size", "2", "--fault_tolerance.lighthouse", lighthouse]
    dump.mkdir(parents=True, exist_ok=True)
    out = (dump / "out.txt").open("wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_late_group_is_recovered_stage_by_stage_and_stays_identical(case: str) -> None:
    from meshforge.train.ft_cli import start_lighthouse

    server = start_lighthouse(0, 1, 1000, 2000)
    root = Path(tempfile.mkdtemp(prefix=f"meshforge-ft-{case}-"))
    g0, g1 = root / "replica_0", root / "replica_1"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(launch(case, 0, g0, server.address()))
        wait_for_step(g0, 2, procs[0])
        procs.append(launch(case, 1, g1, server.address()))  # behind by the steps group 0 takes meanwhile
        deadline = time.monotonic() + 300
        while len(steps(g1)) < JOINT_STEPS or len(steps(g1, 1)) < JOINT_STEPS:
            assert all(p.poll() is None for p in procs), [(d / "out.txt").read_text()[-3000:] for d in (g0, g1)]
            assert time.monotonic() < deadline, "group 1 did not join"
            time.sleep(0.1)
    finally:
        for p in procs:
            kill_tree(p.pid)
        server.shutdown()
    first = steps(g1)[0]["step"]
    assert first > 2 and "recovered step" in (g1 / "out.txt").read_text()
    assert [r["step"] for r in steps(g0)] == list(range(1, len(steps(g0)) + 1))  # none lost, none repeated
    for rank in (0, 1):  # the same stage / shard on both groups: bit-identical from group 1's first step on
        theirs = {r["step"]: r["params_before"] for r in steps(g0, rank)}
        mine = [(r["step"], r["params_before"]) for r in steps(g1, rank) if r["step"] in theirs]
        assert len(mine) >= JOINT_STEPS - 1 and all(d == theirs[s] for s, d in mine), (case, rank, mine, theirs)
        assert all(r["participants"] == 2 for r in steps(g1, rank))
    losses = [json.loads(line)["loss"] for line in (g1 / "metrics.jsonl").read_text().splitlines()]
    assert losses and all(math.isfinite(x) for x in losses)
