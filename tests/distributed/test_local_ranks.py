"""``meshforge train --local-ranks N`` (N ranks in one process, torch local tensors) against one process: losses and
gradient norms of debugmodel (2 layers, 2 steps, fp32) within the parity tolerance for every layout local tensors
run, and a one-line refusal for those they do not (parallel/local_ranks.py, docs/parallelism.md)."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from launcher import run_ranks
from parity import BASE, GLOBAL_BATCH, Trace, assert_parity

SHAPE = ["--model.flavor", "debugmodel", "--model.n_layers", "2", "--training.steps", "2"]
MOE = ["--model.flavor", "debugmoe", "--model.n_layers", "2", "--training.steps", "2"]  # layer 1 is the MoE


def cli_records(argv: list[str]) -> list[dict[str, Any]]:
    """Runs in a forked process: ``meshforge train BASE + argv`` through the command line; its metrics.jsonl."""
    from meshforge.cli import main

    dump = tempfile.mkdtemp(prefix="meshforge-test-")
    code = main(["train", *BASE, "--job.dump_folder", dump, *argv])
    assert code == 0, f"meshforge train exited {code}"
    lines = (Path(dump) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def run(argv: list[str]) -> Trace:
    return Trace(run_ranks(cli_records, 1, argv)[0])  # a forked process: the local world leaves pytest's untouched


@functools.cache
def reference(shape: tuple[str, ...]) -> Trace:
    return run([*shape, "--training.local_batch_size", str(GLOBAL_BATCH)])


LAYOUTS = {  # name: (ranks, shape, overrides); the global batch is GLOBAL_BATCH in every layout
    "tp 2": (2, SHAPE, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "fsdp 2": (2, SHAPE, ["--training.local_batch_size", "4"]),
    "fsdp 2 x tp 2": (4, SHAPE, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "cp 2": (2, SHAPE, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"]),
    "ep 2": (2, MOE, ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_local_ranks_match_one_process(layout: str) -> None:
    ranks, shape, overrides = LAYOUTS[layout]
    got = run(["--local-ranks", str(ranks), *shape, *overrides])
    assert_parity(got, reference(tuple(shape)))


REFUSED = {
    "pp 2": (["--parallelism.pipeline_parallel_degree", "2"], "pipeline parallel builds a different model part"),
    "cp ring": (
        ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_impl", "ring"],
        "context parallel's ring",
    ),
    "compile": (["--compile.enable"], "inductor's compiled code reads"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_local_tensors_cannot_run_is_refused_in_one_line(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    from meshforge.cli import main

    overrides, reason = REFUSED[case]
    code = main(["train", *BASE, *SHAPE, "--local-ranks", "2", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and reason in err and "--nproc 2" in err, err


NO_LOCAL_TENSORS = """
import sys
import torch.distributed.tensor  # torch 2.13's DTensor imports local tensors itself: hide them from meshforge only
sys.modules["torch.distributed._local_tensor"] = None  # a torch without local tensors (the GPU image's may be older)
import meshforge.model.llama, meshforge.parallel.context_parallel, meshforge.train.loop  # noqa: E401, F401
from meshforge.cli import main
sys.exit(main(["train", "--local-ranks", "2", "--parallelism.tensor_parallel_degree", "2"]))
"""


def test_a_torch_without_local_tensors_runs_the_rest_and_refuses_local_ranks_in_one_line() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NO_LOCAL_TENSORS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "needs torch's local tensors" in done.stderr, done.stderr
