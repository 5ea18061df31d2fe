"""One gradient exchange per optimizer step ([gradient_sync] mode = once_per_step, regather = keep;
parallel/gradient_sync.py) against one process, through the layouts and features it meets: FSDP 2 with FSDP CPU
offload, with activation offload, with torch.compile (aot_eager) and with Float8 rowwise; CP 2; EP 2 on the MoE
model; TP 2; FSDP 2 x TP 2; HSDP 2 x 2; PP 1F1B x FSDP 2; torchft replica groups (2 groups x FSDP 2). Each job runs
gradient_accumulation_steps 2 (half the local batch) and must match the single process on the whole global batch,
same seed and data: losses and gradient norms to 1e-6 relative (fp32, as tests/distributed/test_gradient_sync.py
compares them). The jobs of one world size share one launch (a fresh process group and port each, as the
composability matrix runs them: tests/distributed/test_composability_matrix.py), the references one launch of 1,
the torchft groups one ``meshforge train --nproc 4``. The composability table (parallel/composability.py) cites this
test for the ``grad_sync_once`` / ``regather_keep`` cells it proves."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import matrix_cover as mc
import pytest
from test_composability_matrix import launch

from meshforge.parallel.pipeline.catalog import SCHEDULES

pytestmark = pytest.mark.distributed
RTOL = 1e-6
ONCE = ["--training.gradient_accumulation_steps", "2", "--gradient_sync.mode", "once_per_step"]
KEEP = [*ONCE, "--gradient_sync.regather", "keep"]
OFF = {"float8": "off", "ac": "none"}
PP_FSDP = ["--parallelism.data_parallel_shard_degree", "2"]  # with the matrix's pp_<schedule> layout: 4 ranks
PP_BATCH = {"DualPipeV": 16}  # 4 microbatches of 1 per micro-step and rank (one per stage); the others: 2
JOBS: dict[str, tuple[int, mc.Job, list[str]]] = {
    # name: (global batch, matrix job: layout, model, features; extra overrides)
    "fsdp cpu_offload": (4, {"layout": "fsdp", "model": "debugmodel", **OFF}, [*ONCE, "--training.enable_cpu_offload"]),
    "fsdp cpu_offload keep": (
        4,
        {"layout": "fsdp", "model": "debugmodel", **OFF},
        [*KEEP, "--training.enable_cpu_offload"],
    ),
    "fsdp activation_offload keep": (4, {"layout": "fsdp", "model": "debugmodel", **OFF, "offload": "on"}, KEEP),
    "fsdp compile keep": (4, {"layout": "fsdp", "model": "debugmodel", **OFF, "compile": "on"}, KEEP),
    "fsdp float8 keep": (4, {"layout": "fsdp", "model": "debugmodel", "float8": "rowwise", "ac": "none"}, KEEP),
    "cp keep": (4, {"layout": "cp_allgather", "model": "debugmodel", **OFF}, KEEP),
    "cp ring keep": (4, {"layout": "cp_ring", "model": "debugmodel", **OFF}, KEEP),
    "ep moe keep": (4, {"layout": "ep", "model": "debugmoe", **OFF}, KEEP),
    "tp keep": (4, {"layout": "tp", "model": "debugmodel", **OFF}, KEEP),
    "fsdp 2 x tp 2 keep": (8, {"layout": "fsdp_tp_nolp", "model": "debugmodel", **OFF}, KEEP),
    "hsdp 2 x 2 keep": (8, {"layout": "hsdp", "model": "debugmodel", **OFF}, KEEP),  # one sample per micro-step
    **{
        f"pp {name} x fsdp 2 once": (
            PP_BATCH.get(name, 8),
            {"layout": f"pp_{name}", "model": "debugmodel", **OFF},
            [*PP_FSDP, *ONCE],
        )
        for name in SCHEDULES
    },
}


def world(job: mc.Job, extra: list[str]) -> int:
    """The job's ranks: its matrix layout's, twice that with FSDP 2 under a pipeline."""
    return mc.LAYOUTS[job["layout"]][0] * (2 if PP_FSDP[0] in extra else 1)


def job_overrides(batch: int, job: mc.Job, extra: list[str]) -> list[str]:
    """The matrix job's overrides with half the local batch of the global ``batch`` (2 micro-steps), then ``extra``."""
    _, args = mc.overrides(job, compile_backend="aot_eager")
    dp = mc.DP.get(job["layout"], 1) * (2 if PP_FSDP[0] in extra else 1)
    return [*args, "--training.local_batch_size", str(batch // dp // 2), *extra]


def reference(batch: int, job: mc.Job) -> tuple[str, list[str]]:
    """The single process a job compares with (name, overrides): its model and numerics, the whole global batch."""
    key = mc.reference_key(job)
    return f"{key} x {batch}", [*mc.reference_overrides(key), "--training.local_batch_size", str(batch)]


@functools.cache
def references() -> dict[str, tuple[str, Any]]:
    """Every job's single-process run, in one launch of 1 rank (shared by the tests)."""
    return launch(1, dict(reference(b, j) for b, j, _ in JOBS.values()))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_once_per_step_matches_one_process_across_layouts_and_features() -> None:
    runs: dict[str, tuple[str, Any]] = {}
    for ranks in (2, 4):  # one launch per world size
        batch = {name: job_overrides(b, j, x) for name, (b, j, x) in JOBS.items() if world(j, x) == ranks}
        runs |= launch(ranks, batch)
    refs = references()
    problems = []
    for name, (batch, job, _) in JOBS.items():
        status, got = runs[name]
        ref_status, want = refs[reference(batch, job)[0]]
        assert status == ref_status == "ran", (name, runs[name], ref_status)
        problems += [f"{name}: {p}" for p in mismatches(got, want)]
    assert not problems, "\n".join(problems)


def mismatches(got: list[Any], want: list[Any]) -> list[str]:
    """Each step whose loss or grad norm differs from the single process's by more than RTOL (or is not finite)."""
    out = []
    for step, ((loss, norm, _), (w_loss, w_norm, _)) in enumerate(zip(got, want, strict=True), start=1):
        for what, g, w in (("loss", loss, w_loss), ("grad norm", norm, w_norm)):
            if not math.isfinite(g) or abs(g - w) > RTOL * abs(w):
                out.append(f"step {step} {what} {g!r} vs one process {w!r} (rtol {RTOL})")
    return out


FT = ["--fault_tolerance.enable", "--fault_tolerance.local_replicas", "2", "--metrics.progress_bar", "false"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fault_tolerant_groups_with_once_per_step_match_one_process(tmp_path: Path) -> None:
    """torchft: 2 replica groups x FSDP 2 (``meshforge train --nproc 4``), GA 2, once_per_step with keep: FSDP
    reduce-scatters inside a group at the last micro-step, torchft all-reduces the shards across the groups once after
    it (train/fault_tolerance.py ``sync_gradients``). Each group logs its own half of the global batch: their mean
    loss is the single process's, and each group's (global) grad norm is the single process's."""
    pytest.importorskip("torchft", reason="needs torchft: pip install 'meshforge[ft]'")
    from meshforge.train.ft_cli import descendants

    job: mc.Job = {"layout": "fsdp", "model": "debugmodel", **OFF}  # FSDP 2 in each group
    _, args = mc.overrides(job)
    local = 8 // 4 // 2  # a global batch of 8: 2 groups x FSDP 2, 2 micro-steps
    args += ["--training.local_batch_size", str(local), *KEEP, *FT, "--job.dump_folder", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshforge", "train", "--nproc", "4", *args],
        env=env,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        for pid in descendants(proc.pid) if proc.poll() is None else []:  # a run past its timeout: the whole tree
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    groups = [[json.loads(line) for line in (tmp_path / f"replica_{g}" / "metrics.jsonl").open()] for g in (0, 1)]
    _, want = references()[reference(8, job)[0]]  # the whole global batch of 4 ranks
    got = [(sum(r["loss"] for r in rs) / 2, rs[0]["grad_norm"], None) for rs in zip(*groups, strict=True)]
    problems = mismatches(got, want)
    norms = [(r0["grad_norm"], r1["grad_norm"]) for r0, r1 in zip(*groups, strict=True)]
    problems += [f"the groups' grad norms differ: {pair}" for pair in norms if pair[0] != pair[1]]
    assert not problems, "\n".join(problems)
