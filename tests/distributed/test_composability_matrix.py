"""The composability table made true (issue 28): a covering array of 2-step jobs (tests/matrix_cover.py) on
debugmodel / debugmoe / a tiny Qwen3, 2 or 4 gloo ranks, fp32, deterministic. Every job either trains with finite
losses (compared, losses and grad norms, with one process on the same model, data and numerics) or is refused before
step 1 with a one-line ConfigError; every refused cell of the table gets a job. A crash fails the test, and so does
any cell that behaves otherwise than the table says: a refused job where the table refuses nothing, a job that ran
through a refused cell, a cell the run reached that the table calls untested, or a matrix claim the run did not make.

CI (``make test``) runs the pairwise cover over six layouts (matrix_cover.CI_LAYOUTS); ``make test-matrix``
(MESHFORGE_MATRIX=full) runs it over every layout (MESHFORGE_MATRIX_STRENGTH=3: 3-wise). Compile uses the
``aot_eager`` backend (dynamo's tracing and AOT autograd, where composability breaks, without inductor's C++ builds;
MESHFORGE_MATRIX_BACKEND=inductor for those). Jobs of one world size share one launch (a fresh process group and port
per job).
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import matrix_cover as mc
import pytest
from blocking import KSplitMatmul
from launcher import _child, free_port

from meshforge.parallel import composability as table

pytestmark = pytest.mark.distributed
FULL = os.environ.get("MESHFORGE_MATRIX") == "full"
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5
"""The float32 allowance: every job within it is at parity whatever its noise floor."""
TWINS = (2, 3)
"""Each reference runs again with every matmul summed over 2 and 3 slices of its reduced dimension
(tests/blocking.py): its noise floor is the larger relative difference of the twins from it, per metric."""
FLOOR_FACTOR = 4.0
"""A job is at parity within max(the float32 allowance, FLOOR_FACTOR x its reference's floor)
(docs/benchmarks/cpu-parity-noise.md: what was measured on the AMD and the imitated Intel kernels)."""
TWIN = "ksplit="


def run_one(overrides: list[str]) -> tuple[str, Any]:
    """Inside a rank: ("ran", [(loss, grad_norm, val_loss)]) or ("refused", message, steps logged)."""
    import torch
    import torch.distributed as dist

    from meshforge.config.io import load_config
    from meshforge.errors import ConfigError
    from meshforge.parallel.distributed import clear_dtensor_caches
    from meshforge.train.loop import train

    dump = tempfile.mkdtemp(prefix="meshforge-matrix-")
    parts = int(overrides[0].removeprefix(TWIN)) if overrides and overrides[0].startswith(TWIN) else 0
    overrides = overrides[1:] if parts else overrides
    try:
        with KSplitMatmul(parts) if parts else contextlib.nullcontext():
            records = train(load_config(None, [*overrides, "--job.dump_folder", dump]))
        return "ran", [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in records]
    except ConfigError as exc:
        metrics = Path(dump) / "metrics.jsonl"
        steps = sum(1 for _ in metrics.open()) if metrics.exists() else 0
        return "refused", (str(exc), steps)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch._dynamo.reset()
        clear_dtensor_caches()


def job_port(folder: str, index: int) -> int:
    """A free port for job ``index``, chosen by rank 0 just before the job (ports picked at launch were taken by
    other processes minutes later: EADDRINUSE) and read by every rank from ``folder``."""
    path = Path(folder) / f"port{index}"
    if os.environ.get("RANK") == "0":
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(free_port()))
        tmp.rename(path)
    deadline = time.monotonic() + 600
    while not path.exists():
        assert time.monotonic() < deadline, f"rank 0 gave no port for job {index}"
        time.sleep(0.01)
    return int(path.read_text())


def run_batch(jobs: list[tuple[str, list[str], str]]) -> list[tuple[str, str, Any]]:
    """Inside a rank: the jobs one after another, each on its own port; a crash names its job."""
    out = []
    log = os.environ.get("MESHFORGE_MATRIX_LOG") if os.environ.get("RANK") == "0" else None
    for index, (name, overrides, folder) in enumerate(jobs):
        os.environ["MASTER_PORT"] = str(job_port(folder, index))
        start = time.perf_counter()
        try:
            status, detail = run_one(overrides)
        except Exception as exc:
            raise RuntimeError(f"job {name!r} crashed: {type(exc).__name__}: {exc}") from exc
        out.append((name, status, detail))
        if log:  # MESHFORGE_MATRIX_LOG=path: one line per job as it ends (time, outcome)
            with open(log, "a") as f:
                print(f"{time.perf_counter() - start:6.1f}s {status:8s} {name} {detail}", file=f)
    return out


def launch(world: int, jobs: dict[str, list[str]]) -> dict[str, tuple[str, Any]]:
    """The jobs on ``world`` forked ranks (launcher._child); the first rank's error ends every rank at once. Every
    rank must see the same outcome of every job (a refusal on one rank alone leaves the others in a collective)."""
    folder = tempfile.mkdtemp(prefix="meshforge-matrix-ports-")
    batch = [(name, args, folder) for name, args in jobs.items()]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(run_batch, r, world, free_port(), queue, (batch,))) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            rank, (kind, value) = queue.get(timeout=120 + 60 * len(batch))
            assert kind == "ok", f"rank {rank}: {value}"
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world else 0.1)
            if p.is_alive():
                p.kill()
    statuses = {r: [status for _, status, _ in res] for r, res in results.items()}
    assert all(s == statuses[0] for s in statuses.values()), statuses
    return {name: (status, detail) for name, status, detail in results[0]}


def run_matrix(jobs: list[mc.Job], backend: str, layouts: tuple[str, ...] | None) -> dict[str, Any]:
    """Every job and refusal job, batched by world size, and the single-process references."""
    named = {f"job{i} {mc.describe(j)}": j for i, j in enumerate(jobs)}
    named |= {f"refuse {row} x {col}: {mc.describe(j)}": j for (row, col), j in mc.refusal_jobs(layouts)}
    by_world: dict[int, dict[str, list[str]]] = {}
    for name, job in named.items():
        world, args = mc.overrides(job, compile_backend=backend)
        by_world.setdefault(world, {})[name] = args
    keys = sorted({mc.reference_key(j) for j in jobs})
    by_world.setdefault(1, {}).update({f"ref {k}": mc.reference_overrides(k) for k in keys})
    twins = {f"twin{p} {k}": [f"{TWIN}{p}", *mc.reference_overrides(k)] for k in keys if k[1] != "off" for p in TWINS}
    by_world[1].update(twins)
    results: dict[str, tuple[str, Any]] = {}
    for world, batch in sorted(by_world.items()):
        results |= launch(world, batch)
    return {"named": named, "results": results}


def outcome(job: mc.Job, result: tuple[str, Any], refs: dict[str, tuple[str, Any]]) -> str:
    """ "parity" (finite, equal to one process), "runs" (finite) or "refused"; AssertionError on anything else."""
    status, detail = result
    if status == "refused":
        message, steps = detail
        assert steps == 0 and "\n" not in message, (job, detail)
        return "refused"
    assert len(detail) == 2 and all(math.isfinite(loss) and math.isfinite(g) for loss, g, _ in detail), (job, detail)
    assert job.get("validation") != "on" or all(v is not None and math.isfinite(v) for *_, v in detail), detail
    ref_status, want = refs[f"ref {mc.reference_key(job)}"]
    assert ref_status == "ran", (mc.reference_key(job), want)
    loss_tol, grad_tol = tolerances(mc.reference_key(job), refs)
    loss_rel, grad_rel = max_rel(detail, want)
    return "parity" if loss_rel <= loss_tol and grad_rel <= grad_tol else "runs"


def max_rel(got: list[Any], want: list[Any]) -> tuple[float, float]:
    """The largest relative difference over the steps of the losses and of the gradient norms."""
    pairs = list(zip(got, want, strict=True))
    loss = max(abs(g[0] - w[0]) / abs(w[0]) for g, w in pairs)
    return loss, max(abs(g[1] - w[1]) / abs(w[1]) for g, w in pairs)


def tolerances(key: tuple[str, ...], refs: dict[str, tuple[str, Any]]) -> tuple[float, float]:
    """(loss, grad norm) relative tolerances of the jobs compared with reference ``key``: the float32 allowance, or
    FLOOR_FACTOR x the reference's measured noise floor where that is larger (Float8 runs)."""
    want = refs[f"ref {key}"][1]
    floors = [max_rel(refs[f"twin{p} {key}"][1], want) for p in TWINS if f"twin{p} {key}" in refs]
    loss_floor, grad_floor = (max((f[i] for f in floors), default=0.0) for i in (0, 1))
    return max(LOSS_RTOL, FLOOR_FACTOR * loss_floor), max(GRAD_RTOL, FLOOR_FACTOR * grad_floor)


def judge(run: dict[str, Any]) -> tuple[dict[tuple[str, str], str], list[str]]:
    """Each job against the table: the best status the run proved for each cell it reached, and the problems."""
    proved: dict[tuple[str, str], str] = {}
    problems: list[str] = []
    for name, job in run["named"].items():
        got = outcome(job, run["results"][name], run["results"])
        refused: list[object] = [c for c in mc.cells(job) if table.cell(*c).status == "refused"]
        refused += [rule.reason for rule in [mc.interaction(job)] if rule is not None]
        if got == "refused" and not refused:
            problems.append(f"{name}: refused ({run['results'][name][1][0]}) but the table refuses none of its cells")
        if got != "refused" and refused:
            problems.append(f"{name}: ran through refused cells {refused}")
        for c in mc.cells(job) if got != "refused" else []:
            parity = got == "parity" and c[1] != "validation"  # validation losses are checked finite, not compared
            proved[c] = "parity-tested" if parity or proved.get(c) == "parity-tested" else "runs"
    for c, status in sorted(proved.items()):
        entry = table.cell(*c)
        if entry.status == "untested":
            problems.append(f"cell {c}: the run proves {status!r}, the table says untested")
    for c, (status, test) in sorted(table.MEASURED.items()):
        if test == run["test"] and (c not in proved or (status == "parity-tested" and proved[c] != status)):
            problems.append(f"cell {c}: the table claims {status!r} from {test}, the run proved {proved.get(c)}")
    return proved, problems


def record(test: str, proved: dict[tuple[str, str], str], seconds: float, n_jobs: int) -> None:
    """MESHFORGE_MATRIX_OUT=path: the proved cells and the wall time as JSON (to regenerate MEASURED)."""
    out = os.environ.get("MESHFORGE_MATRIX_OUT")
    if out:
        cells = {f"{p}|{f}": s for (p, f), s in sorted(proved.items()) if (p, f) not in table.CELLS}
        info = {"test": test, "seconds": round(seconds), "jobs": n_jobs, "counts_before": table.counts()}
        Path(out).write_text(json.dumps({**info, "cells": cells}, indent=1))


def check(test: str, strength: int, layouts: tuple[str, ...] | None) -> None:
    start = time.perf_counter()
    backend = os.environ.get("MESHFORGE_MATRIX_BACKEND", "aot_eager")
    run = run_matrix(mc.cover(strength, layouts=layouts), backend, layouts) | {"test": test}
    proved, problems = judge(run)
    record(test, proved, time.perf_counter() - start, len(run["named"]))
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pairwise_matrix() -> None:
    """CI: the pairwise cover over the CI layouts (matrix_cover.CI_LAYOUTS)."""
    check("test_pairwise_matrix", 2, mc.CI_LAYOUTS)


@pytest.mark.slow
@pytest.mark.timeout(14400)
@pytest.mark.skipif(not FULL, reason="every layout, pairwise (3-wise: MESHFORGE_MATRIX_STRENGTH=3): make test-matrix")
def test_full_matrix() -> None:
    check("test_full_matrix", int(os.environ.get("MESHFORGE_MATRIX_STRENGTH", "2")), None)
