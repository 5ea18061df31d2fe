"""The planner's memory terms per category against the exact fake-tensor step on every published layout it traces.

tests/fixtures/exact_memory.json is rank 0's peak by category from tools/memory_run.py (regenerate it with
``PYTHONPATH=src python scripts/exact_memory_fixture.py`` after a change to the model, parallelize or the tracker);
plan/physics/peak.py's categories (before the fitted slack) must match it: each category within CATEGORY_TOL of the
exact peak, every peak within PEAK_TOL, and the median peak error within MEDIAN_TOL. Planting any of the bugs the exact
run found fails it: gradients counted at the loss peak (+3.7 GiB on 8B FSDP 8), the old buffers (two gathered blocks,
the root, unsharded gradients: +6.8 GiB), one reduce-scatter output per block under TP (-3 GiB on 8B TP 8), the head's
saved inputs dropped (-0.75 GiB on every 8B row: the median moves past 1 %).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from meshforge.plan.accuracy.exact import exact_groups, planner_groups

FIXTURE = Path("tests/fixtures/exact_memory.json")
CATEGORY_TOL = 0.05
"""|planner - exact| per category, as a fraction of the exact peak (the largest residual: A100 70B FSDP 64's block
backward working set, -1.3 GiB of 39.6: CPU and GPU attention kernels keep different temporaries)."""
PEAK_TOL = 0.05
"""Issue 44's bar: the planner within 5 % of the exact step on every row (largest: 405B seq 256K PP 8, +4.8 %)."""
MEDIAN_TOL = 0.02
"""1.7 % over the 30 layouts: the exact step's pipeline stage holds whole forwards (5 on NeMo's 70B rank 0 where the
schedule holds 4.6: the planner counts the schedule's, -2 to -3 % on those six rows) and, on a first stage under full
AC, counts one block input per held forward fewer than the planner (TorchTitan's PP rows, +1.7 to +4.8 %): both noted
in docs/benchmarks/memory-at-scale.md, not yet resolved."""
LAYOUTS = json.loads(FIXTURE.read_text())["layouts"]


def _errors(layout: dict[str, object]) -> tuple[dict[str, float], dict[str, float]]:
    exact = exact_groups(layout["by_category"])  # type: ignore[arg-type]
    planner = planner_groups(list(layout["overrides"]), int(layout["world_size"]))  # type: ignore[call-overload]
    return exact, planner


def test_fixture_covers_every_traceable_published_layout() -> None:
    from meshforge.plan.accuracy.published import RUNS

    covered = {row for layout in LAYOUTS for row in layout["rows"]}
    not_pp = {r.key for r in RUNS if "--parallelism.pipeline_parallel_degree" not in r.overrides}
    assert not_pp <= covered, sorted(not_pp - covered)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[str(x["rows"][0]) for x in LAYOUTS])
def test_planner_categories_match_the_exact_step(layout: dict[str, object]) -> None:
    exact, planner = _errors(layout)
    peak = sum(exact.values())
    for name in exact:
        gap = planner[name] - exact[name]
        assert abs(gap) <= CATEGORY_TOL * peak, (
            f"{name}: planner {planner[name] / 2**30:.2f} GiB, exact {exact[name] / 2**30:.2f} GiB "
            f"({gap / peak:+.1%} of the exact peak {peak / 2**30:.2f} GiB)"
        )
    assert sum(planner.values()) / peak - 1 == pytest.approx(0, abs=PEAK_TOL)


def test_median_peak_error_is_small() -> None:
    errors = []
    for layout in LAYOUTS:
        exact, planner = _errors(layout)
        errors.append(abs(sum(planner.values()) / sum(exact.values()) - 1))
    assert statistics.median(errors) <= MEDIAN_TOL, f"median |planner / exact - 1| = {statistics.median(errors):.2%}"


GPU_WINDOW = json.loads(Path("docs/benchmarks/gpu/memory_expected.json").read_text())
"""The GPU window's one-rank memory checks (Llama 3.2 1B / 3B, seq 8192, bf16 under autocast: no FSDP) with the exact
step's peak (scripts/gpu_window_memory.py expect)."""


@pytest.mark.parametrize("name", sorted(GPU_WINDOW))
def test_planner_matches_the_exact_step_on_one_rank_under_autocast(name: str) -> None:
    """Without FSDP training computes under autocast (fp32 residual stream, cast copies of inputs and weights): the
    planner's terms for it (memory.autocast_bytes_per_token, peak.autocast_weight_bytes) within PEAK_TOL."""
    flags = [f for f in GPU_WINDOW[name]["flags"] if f not in ("--training.device", "cuda", "--training.deterministic")]
    planner = sum(planner_groups(flags, 1).values()) / 2**30
    exact = GPU_WINDOW[name]["exact_peak_gib"]
    assert planner / exact - 1 == pytest.approx(0, abs=PEAK_TOL), (planner, exact)
