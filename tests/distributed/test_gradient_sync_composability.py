"""One gradient exchange per optimizer step ([gradient_sync] mode = once_per_step, regather = keep;
parallel/gradient_sync.py) against one process, through the layouts and features it meets: FSDP 2 with FSDP CPU
offload, with activation offload, with torch.compile (aot_eager) and with Float8; CP 2; EP 2 on the MoE model; TP 2.
Each 2-rank job runs gradient_accumulation_steps 2 (half the local batch) and must match the single process on the
whole global batch, same seed and data: losses and gradient norms to 1e-6 relative (fp32, as
tests/distributed/test_gradient_sync.py compares them). The jobs share one launch of 2 ranks (a fresh process group
and port each, as the composability matrix runs them: tests/distributed/test_composability_matrix.py) and the
references one launch of 1; the composability table (parallel/composability.py) cites this test for the
``grad_sync_once`` / ``regather_keep`` cells it proves."""

from __future__ import annotations

import math
from typing import Any

import matrix_cover as mc
import pytest
from test_composability_matrix import launch

pytestmark = pytest.mark.distributed
RTOL = 1e-6
ONCE = ["--training.gradient_accumulation_steps", "2", "--gradient_sync.mode", "once_per_step"]
KEEP = [*ONCE, "--gradient_sync.regather", "keep"]
OFF = {"float8": "off", "ac": "none"}
PP_FSDP = ["--parallelism.data_parallel_shard_degree", "2"]  # with the matrix's pp_1F1B layout: 4 ranks
JOBS: dict[str, tuple[int, mc.Job, list[str]]] = {
    # name: (ranks, matrix job: layout, model, features; extra overrides)
    "fsdp cpu_offload": (2, {"layout": "fsdp", "model": "debugmodel", **OFF}, [*ONCE, "--training.enable_cpu_offload"]),
    "fsdp cpu_offload keep": (
        2,
        {"layout": "fsdp", "model": "debugmodel", **OFF},
        [*KEEP, "--training.enable_cpu_offload"],
    ),
    "fsdp activation_offload keep": (2, {"layout": "fsdp", "model": "debugmodel", **OFF, "offload": "on"}, KEEP),
    "fsdp compile keep": (2, {"layout": "fsdp", "model": "debugmodel", **OFF, "compile": "on"}, KEEP),
    "fsdp float8 keep": (2, {"layout": "fsdp", "model": "debugmodel", "float8": "rowwise", "ac": "none"}, KEEP),
    "cp keep": (2, {"layout": "cp_allgather", "model": "debugmodel", **OFF}, KEEP),
    "ep moe keep": (2, {"layout": "ep", "model": "debugmoe", **OFF}, KEEP),
    "tp keep": (2, {"layout": "tp", "model": "debugmodel", **OFF}, KEEP),
    "fsdp 2 x tp 2 keep": (4, {"layout": "fsdp_tp_nolp", "model": "debugmodel", **OFF}, KEEP),
    "hsdp 2 x 2 keep": (4, {"layout": "hsdp", "model": "debugmodel", **OFF}, KEEP),
    "pp 1F1B x fsdp 2 once": (4, {"layout": "pp_1F1B", "model": "debugmodel", **OFF}, [*PP_FSDP, *ONCE]),
}


def job_overrides(world: int, job: mc.Job, extra: list[str]) -> list[str]:
    """The matrix job's overrides at half the local batch of the global batch (``global_batch``), then ``extra``."""
    _, args = mc.overrides(job, compile_backend="aot_eager")
    dp = mc.DP.get(job["layout"], 1) * (2 if PP_FSDP[0] in extra else 1)
    return [*args, "--training.local_batch_size", str(global_batch(world) // dp // 2), *extra]


def global_batch(world: int) -> int:
    """The matrix's global batch on 2 ranks; twice it on 4 (HSDP 2 x 2: one sample per rank and micro-step)."""
    return mc.GLOBAL_BATCH * world // 2


def reference(world: int, job: mc.Job) -> tuple[str, list[str]]:
    """The single process a job compares with (name, overrides): its model and numerics, the whole global batch."""
    key = mc.reference_key(job)
    return f"{key} x {global_batch(world)}", [
        *mc.reference_overrides(key),
        "--training.local_batch_size",
        str(global_batch(world)),
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_once_per_step_matches_one_process_across_layouts_and_features() -> None:
    runs: dict[str, tuple[str, Any]] = {}
    for world in (2, 4):  # one launch per world size
        runs |= launch(world, {name: job_overrides(w, j, x) for name, (w, j, x) in JOBS.items() if w == world})
    refs = launch(1, dict(reference(w, j) for w, j, _ in JOBS.values()))
    problems = []
    for name, (world, job, _) in JOBS.items():
        status, got = runs[name]
        ref_status, want = refs[reference(world, job)[0]]
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
