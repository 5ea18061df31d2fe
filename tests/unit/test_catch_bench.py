"""Cases no test built (issue 43 item 8): the bench matrix resolved for CUDA on a machine without a GPU, repetitions
of unequal wall time against the sweep's time budget, and a GPU check dropped for time followed by one that still
fits (scripts/gpu_check_budgets.py)."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from meshforge.bench import machine, schedule
from meshforge.bench.matrix import parse_matrix
from meshforge.bench.spec import BenchMatrix

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "configs" / "bench" / "default.toml"


def on_cuda(monkeypatch: pytest.MonkeyPatch, gpus: int, **head: int) -> BenchMatrix:
    """The default matrix (``head`` over its [bench] keys) resolved for ``gpus`` CUDA devices on a 2-core host (no
    GPU needed: the count is patched)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(machine, "cpu_cores", lambda: 2)
    tree = tomllib.loads(DEFAULT.read_text())
    tree["bench"] |= head
    return parse_matrix(tree, device="cuda")


def test_the_default_matrix_on_eight_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank per GPU, not per core: ranked at 4 (the matrix's cap), nothing oversubscribed (cores 0: the 8-rank
    3D row runs on 8 GPUs and gets the full 3 repetitions), the CPU-only keys (Float8 emulated) left out."""
    matrix = on_cuda(monkeypatch, 8)
    runs = {r.name: r for r in matrix.runs}
    assert (matrix.cores, matrix.ranked_ranks) == (0, 4)
    assert runs["tp"].layout()["tp"] == 4 and runs["pp_1f1b"].layout()["pp"] == 4 and runs["fsdp"].dp == 4
    assert runs["3d"].ranks == 8 and not any(matrix.oversubscribed(r) for r in matrix.runs)
    assert {schedule.minimum_repeat(matrix, r) for r in matrix.runs} == {3}
    fp8 = runs["fsdp_float8"]
    assert "quantize.dense.float8.emulate" not in fp8.overrides and not matrix.flags_of(fp8)["float8_emulate"]
    args = matrix.train_args(fp8, "out")
    assert "--quantize.dense.float8.enable" in args and "--quantize.dense.float8.emulate" not in args
    assert matrix.scaling["fsdp_scaling"] == ["fsdp_r1", "fsdp_r2", "fsdp"]
    wider = on_cuda(monkeypatch, 8, max_ranked_ranks=8, global_batch_size=8)  # the GPUs, not the 2 cores, count
    assert wider.ranked_ranks == 8 and wider.run("tp").layout()["tp"] == 8 and wider.run("cp").layout()["cp"] == 8


def test_the_default_matrix_without_a_visible_gpu_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolved for CUDA where no GPU is visible: at least 2 ranks (a comparison needs a collective), still no cores
    (a GPU rank is never oversubscribed), and the CPU-only keys still left out."""
    matrix = on_cuda(monkeypatch, 0)
    assert (matrix.cores, matrix.ranked_ranks) == (0, 2)
    assert not matrix.run("fsdp_float8").overrides


def default_cpu() -> BenchMatrix:
    tree = tomllib.loads(DEFAULT.read_text())
    tree["bench"] |= {"cores": 2, "ranked_ranks": 2}
    return parse_matrix(tree, device="cpu")


def test_unequal_repetitions_are_budgeted_at_their_median() -> None:
    """Past the minimum, a repetition starts only if the time so far plus the median of the run's earlier walls fits
    the budget (160 s): walls 100, 20, 30, 5 (and a refused repetition of 0 s, not counted) have median 25, so it
    starts at 135 s and not at 136 s; the first (100), the last (5), the mean (38.75) or a median counting the 0 (20)
    would each decide one of the two differently."""
    matrix = default_cpu()
    fsdp = matrix.run("fsdp")
    assert matrix.time_budget_s == 160 and schedule.minimum_repeat(matrix, fsdp) == 3
    reps = [{"status": "ok", "wall_s": w} for w in (100.0, 20.0, 30.0, 5.0)] + [{"status": "ok", "wall_s": 0.0}]
    assert schedule.fits(matrix, fsdp, reps, elapsed_s=135.0)
    assert not schedule.fits(matrix, fsdp, reps, elapsed_s=136.0)
    assert schedule.fits(matrix, fsdp, reps[:2], elapsed_s=1000.0)  # within the minimum: always


def load_budgets() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_budgets_catch", REPO / "scripts" / "gpu_check_budgets.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_dropped_check_leaves_room_for_later_ones_that_fit() -> None:
    """In the plan's order: a check that does not fit on top of those kept is dropped, and the time it would have
    taken is not counted, so a later, shorter check still runs; a reference goes with the check it serves (its time
    counted with it); a check that fits exactly is kept."""
    fit = load_budgets().fit
    assert fit({"a": 300, "b": 250, "c": 100}, 480) == (["a", "c"], ["b"])
    assert fit({"a": 300, "b": 180}, 480) == (["a", "b"], [])
    pair = {"env": 15, "mfu_1b_eager": 100, "mfu_1b": 400, "dense_ref": 25}
    assert fit(pair, 480) == (["env", "dense_ref"], ["mfu_1b_eager", "mfu_1b"])  # 15 + 500 > 480
    pair = {"env": 15, "mfu_1b_eager": 100, "mfu_1b": 300, "moe_ref": 100, "dense_ref": 50}
    assert fit(pair, 480) == (["env", "mfu_1b_eager", "mfu_1b", "dense_ref"], ["moe_ref"])
